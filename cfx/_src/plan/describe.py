"""``Plan.describe(model)``: what one rank holds, by kind, before anything runs.

Everything is computed on shapes: the stored layout's blocks (``layout``), the optimizer's
state from a shape-only ``init`` in a rank's context (``program.eval_on_rank``) on an
``AbstractMesh`` -- the same code the step runs, so the figures are the step's, not a formula's.
Every rank of a Plan holds the same shapes, so one rank speaks for all.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh.layout import block_shape
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.mesh.spec import is_spec
from cfx._src.optim.alias import adamw
from cfx._src.plan.layout import Layout
from cfx._src.plan.program import Program
from cfx._src.plan.rehearse import rehearse
from cfx._src.plan.build import check_model, eval_on_rank, gathered_model, make_optimizer, make_placement
from cfx._src.transforms.shapes import ShapeDtype
from cfx._src.core.text import format_table
from cfx._src.zero.flat import piece_size
from cfx._src.zero.offload import gather_groups
from cfx._src.models.parts import hook
from cfx._src.parallel.expert import has_experts


@dataclasses.dataclass(frozen=True)
class Description:
    """Per-rank bytes by kind (``bytes``) of ``plan`` for a model of ``n_params`` parameters."""

    plan: str
    n_params: int
    bytes: dict[str, int]
    tiers: dict[str, str]  # per kind: device or host
    # with a batch: per mesh axes ("data", "model", "data.model", ...) and phase ("forward", which
    # includes the optimizer's, or "backward"), the payload bytes one rank hands to collectives in a
    # step (the most of any rank)
    collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def model_state(self) -> int:
        """Params + grads + optimizer state: what ZeRO's 16 Psi / N counts."""
        return self.bytes["params"] + self.bytes["grads"] + self.bytes["optimizer"]

    def rows(self) -> list[tuple[str, str, str]]:
        out = [(k, self.tiers[k], f"{v:,}") for k, v in self.bytes.items()]
        state = {self.tiers[k] for k in ("params", "grads", "optimizer")}
        return out + [("model state (params + grads + optimizer)", "/".join(sorted(state)), f"{self.model_state:,}")]

    def __str__(self) -> str:
        out = str(format_table(self.rows(), [f"per rank: {self.plan}", "tier", "bytes"]))
        if self.collectives:
            rows = [(axes, phase, f"{b:,}") for axes, by in sorted(self.collectives.items())
                    for phase, b in sorted(by.items())]
            out += "\n\n" + str(format_table(rows, ["collectives over", "phase", "bytes per rank and step"]))
        return out


def describe(plan, model: Any, tx: Any = None, *, batch: tuple[int, int] | None = None) -> Description:
    """Per-rank bytes of params, grads, optimizer state, (ZeRO-3) one gathered block and (offload)
    the chunk copies on the device at once (``host``: one; ``auto``: at most the budget), with
    the tier each lives on; ``tx`` defaults to AdamW. With ``batch=(rows, seq)`` (a global batch)
    every rank's step is also rehearsed on shapes (``rehearse``): the peak bytes of its
    activations (op outputs and saved tensors, gradients in flight included) and the collectives
    it issues per axis and phase. Raises the ValueErrors ``plan.check(model)`` raises."""
    check_model(plan, model)
    mesh = AbstractMesh(plan.mesh_shape or {"data": 1})
    layout = Layout(plan, model, mesh)
    opt, _ = make_optimizer(plan, tx if tx is not None else adamw(1e-3), layout, mesh)
    if layout.zero3:
        local = layout.local_abstract()
        gathered = max(_nbytes(g) for g in _gathered_groups(plan, model, layout))
    elif layout.opt_on_local:  # the optimizer steps each rank's blocks one by one
        local, gathered = layout.local_abstract(), 0
    else:
        specs = tree_util.leaves(layout.specs, is_leaf=is_spec)
        leaves, treedef = tree_util.flatten(layout.shapes)
        local = tree_util.unflatten(treedef, [ShapeDtype(block_shape(x.shape, s, mesh), x.dtype)
                                              for x, s in zip(leaves, specs)])
        gathered = 0
    state = eval_on_rank(mesh, opt.init, local)
    params = _nbytes(tree_util.leaves(local))
    out = {"params": params, "grads": params, "optimizer": _nbytes(tree_util.leaves(state))}
    if layout.zero3:
        out["gathered block"] = gathered
    if plan.offload != "none":  # the model state at home; the device holds chunk copies
        local_model = gathered_model(plan, model)
        budget = plan.offload_budget or 1 << 62
        chunks = make_placement(plan, local_model, layout, budget).chunk_bytes
        out["device chunks"] = chunks[0] if plan.offload == "host" else min(sum(chunks), budget)
    home = {"none": "device", "nvme": "nvme"}.get(plan.offload, "host")
    tiers = dict.fromkeys(out, "device")
    tiers.update(params=home, optimizer=home, grads="device" if home == "device" else "host")
    n_params = sum(math.prod(x.shape) for x in tree_util.leaves(layout.model_shapes))
    collectives: dict[str, dict[str, int]] = {}
    if batch is not None:
        if hook(model, "check_train_batch") is not None:
            raise ValueError(f"Plan {str(plan)!r}: describe(batch=) rehearses a token model's step on (rows, seq); "
                             f"{type(model).__name__} takes a batch of its own. Drop batch= (the model state's "
                             "bytes are still described), or measure its step with cfx.memory.track(ops=True).")
        if has_experts(model):
            raise ValueError(f"Plan {str(plan)!r}: describe(batch=) rehearses the step on shapes, and a mixture of "
                             "experts' routing sizes its expert batches from the data. Drop batch= (the model "
                             "state's bytes are still described), or measure a step with cfx.memory.track(ops=True).")
        rows, seq = batch
        plan.check_batch(rows, seq)
        program = Program(plan, model, tx if tx is not None else adamw(1e-3), mesh)
        if plan.remat == "auto":
            program._solve_remat(torch.zeros((rows, seq), dtype=torch.long), None)
        runs = [rehearse(program, rows, seq, r) for r in range(mesh.size)]
        out["activations"] = max(r.activations for r in runs)
        tiers["activations"] = "device"
        for r in runs:
            for (axes, phase), b in r.sent().items():
                by = collectives.setdefault(axes, {})
                by[phase] = max(by.get(phase, 0), b)
    return Description(str(plan), n_params, out, tiers, collectives)


def _gathered_groups(plan, model: Any, layout: Layout) -> list[list[ShapeDtype]]:
    """Each gathered block's leaves as one rank gathers them (its tensor-parallel shapes, padded to
    the data axis like the gathered buffer); the model's own group where it has no blocks."""
    paths = [p for p, _ in tree_util.flatten_with_path(layout.model_shapes)[0]]
    groups = gather_groups(gathered_model(plan, model), paths)  # the root's own leaves first
    shapes = tree_util.leaves(layout.model_shapes)
    specs = tree_util.leaves(layout.model_specs, is_leaf=is_spec)
    n = layout.n
    return [[ShapeDtype((piece_size(math.prod(block_shape(shapes[i].shape, specs[i], layout.mesh)), n) * n,),
                        shapes[i].dtype) for i in idx] for idx in (groups[1:] or groups)]


def _nbytes(leaves: list) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves if hasattr(x, "dtype"))
