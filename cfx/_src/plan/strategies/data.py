"""Data parallelism over ``data``, with ZeRO: the batch's rows split over it; ``zero=0`` one flat
all-reduce of the gradients per step, ZeRO 1/2 one reduce-scatter into this rank's shard of the flat
optimizer state and the update all-gathered back, ZeRO-3 the params themselves in pieces: each block,
then what is left of the model, gathered just before use and freed after (``cfx.zero.gathered``), the
gradients reduce-scattered in backward."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh.layout import block_shape
from cfx._src.mesh.spec import is_spec
from cfx._src.nn.fp8 import E4M3
from cfx._src.parallel.state import tree_pmean
from cfx._src.plan.on_rank import per_rank_specs
from cfx._src.precision.amp import policy
from cfx._src.plan.strategy import Account, Built, Strategy
from cfx._src.transforms.shapes import ShapeDtype
from cfx._src.zero.flat import piece_size
from cfx._src.zero.gathered import gathered
from cfx._src.zero.offload import gather_groups
from cfx._src.zero.optimizer import ZeroTransformation


class Data(Strategy):
    name, axes = "data", ("data",)

    def check_plan(self, plan) -> None:
        if plan.zero and not plan.has("data"):
            raise ValueError(f"Plan: zero={plan.zero} shards over the data axis, and the mesh "
                             f"{dict(plan.mesh)} has none; add data=N to the mesh or use zero=0.")

    def place_frozen(self, plan, placer, model) -> Any:
        """ZeRO-3: frozen weights in pieces over ``data`` as the params are."""
        return dataclasses.replace(placer, axis="data") if plan.zero == 3 and plan.has("data") else placer

    def wrap_block(self, plan, block) -> Any:
        return gathered(block, axis="data", fp8_grads=_fp8_grads(plan)) if plan.zero == 3 else block

    def wrap_root(self, plan, model) -> Any:
        return gathered(model, axis="data", fp8_grads=_fp8_grads(plan)) if plan.zero == 3 else model

    def reduce(self, plan, grads: Any, built: Built) -> Any:
        """``zero=0``: the gradients averaged over ``data`` in one flat all-reduce (ZeRO reduces its own)."""
        return tree_pmean(grads, "data") if plan.has("data") and not plan.zero else grads

    def wrap_optimizer(self, plan, tx, built: Built) -> tuple[Any, Any] | None:
        """ZeRO 1-3 around ``tx``: over each rank's view of the model's tree where the optimizer steps
        that (ZeRO-3's pieces, a pipe stage's blocks), else over the stored layout."""
        layout, mesh = built.layout, built.mesh
        if not plan.zero:
            return None
        if layout.opt_on_local:
            split, total = layout.norm_axes()
            opt = ZeroTransformation(tx, plan.zero, "data", layout.local_specs,
                                     owner_axes=[t[len(s):] for s, t in zip(split, total)], tier=plan.home)
            return opt, per_rank_specs(mesh, opt.init, layout.local_abstract())
        opt = ZeroTransformation(tx, plan.zero, "data", layout.specs)
        return opt, opt.state_specs(layout.shapes, mesh=mesh)

    def account(self, plan, acc: Account, built: Built) -> None:
        """ZeRO-3: the largest block one rank gathers at once (its tensor-parallel leaves, padded)."""
        if plan.zero == 3:
            acc.add("gathered block", max(tree_util.nbytes(g) for g in _gathered_groups(built)))


def _fp8_grads(plan) -> bool:
    """``fp8_comm=reduce_scatter``: ZeRO-3's gradients reduce-scattered as e5m2 casts."""
    return "reduce_scatter" in plan.fp8_comm.split("+")


def _gathered_groups(built: Built) -> list[list[ShapeDtype]]:
    """Each gathered block's leaves as one rank gathers them (its tensor-parallel shapes, padded to
    the data axis like the gathered buffer; a float8 all-gather's weights in e4m3); the model's own
    group where it has no blocks."""
    layout = built.layout
    paths = [p for p, _ in tree_util.flatten_with_path(layout.model_shapes)[0]]
    groups = gather_groups(built.local, paths)  # the root's own leaves first
    shapes = tree_util.leaves(layout.model_shapes)
    specs = tree_util.leaves(layout.model_specs, is_leaf=is_spec)
    n, fp8 = layout.n, _float8_leaves(built.local)
    compute = policy(built.plan.precision).compute_dtype  # (the pieces are cast to it before the gather)

    def dtype(i: int) -> torch.dtype:
        return E4M3 if paths[i] in fp8 else compute if shapes[i].dtype.is_floating_point else shapes[i].dtype
    return [[ShapeDtype((piece_size(math.prod(block_shape(shapes[i].shape, specs[i], layout.mesh)), n) * n,),
                        dtype(i)) for i in idx] for idx in (groups[1:] or groups)]


def _float8_leaves(model: Any) -> set[str]:
    """The paths (``blocks.3.attn.q.w``) of the weights ZeRO-3 gathers as their e4m3 casts (a block's
    ``Float8Layer.gathered_in_fp8``, read through the wrappers around it)."""
    out = set()
    for i, block in enumerate(getattr(model, "blocks", ())):
        out |= {f"blocks.{i}.{p}" for p in (getattr(block, "gathered_in_fp8", None) or
                                           getattr(getattr(block, "layer", None), "gathered_in_fp8", None) or {})}
    return out



