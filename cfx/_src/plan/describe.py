"""``Plan.describe(model)``: what one rank holds, by kind, before anything runs.

Everything is computed on shapes, by the plan's own accounting (``build.account``: the stored
layout's blocks, the optimizer's state from a shape-only ``init`` in a rank's context on an
``AbstractMesh``, then each strategy's ``account``) -- the same code the step runs, so the figures
are the step's, not a formula's. Every rank of a Plan holds the same shapes, so one rank speaks for all.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cfx._src.core import random, tree as tree_util
from cfx._src.core.text import format_table
from cfx._src.lax.stats import CommStats
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.models.parts import hook
from cfx._src.optim.alias import adamw
from cfx._src.parallel.expert import has_experts
from cfx._src.plan.build import account, arrange_batch, check_model
from cfx._src.plan.program import Program
from cfx._src.plan.rehearse import rehearse
from cfx._src.transforms.shapes import eval_shape


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
    # with a batch: every rank's collectives one by one (``cfx.comm_stats``' records: op, axes, payload)
    records: tuple = ()

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
    """Per-rank bytes of params, grads and optimizer state with the tier each lives on, and what the
    plan's strategies add -- ZeRO-3's one gathered block, offload's chunk copies on the device at once
    (``host``: one; ``auto``: at most the budget) -- each strategy's own accounting (``account``);
    ``tx`` defaults to AdamW. With ``batch=(rows, seq)`` (a global batch) every rank's step is also
    rehearsed on shapes (``rehearse``): the peak bytes of its activations (op outputs and saved
    tensors, gradients in flight included) and the collectives it issues per axis and phase. Raises
    the ValueErrors ``plan.check(model)`` raises."""
    check_model(plan, model)
    mesh = AbstractMesh(plan.mesh_shape or {"data": 1})
    tx = tx if tx is not None else adamw(1e-3)
    acc = account(plan, model, tx, mesh)
    out, tiers = acc.bytes, acc.tiers
    n_params = sum(math.prod(x.shape) for x in tree_util.leaves(eval_shape(model.init, random.key(0))))
    collectives: dict[str, dict[str, int]] = {}
    records: tuple = ()
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
        program = Program(plan, model, tx, mesh)
        tokens = torch.zeros((rows, seq), dtype=torch.long)
        body = program.body_for(arrange_batch(plan, model, (tokens, tokens)))  # remat=auto: solved for it
        runs = [rehearse(program, body, rows, seq, r) for r in range(mesh.size)]
        out["activations"] = max(r.activations for r in runs)
        tiers["activations"] = "device"
        sent = CommStats()
        sent.records = [rec for r in runs for rec in r.records]
        collectives = sent.sent()
        records = tuple(sent.records)
    return Description(str(plan), n_params, out, tiers, collectives, records)


