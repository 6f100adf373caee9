"""Activation checkpointing: per block (``remat=blocks``: each block keeps only its input; ``dots``:
its matmul outputs too), outermost around a block (it re-gathers ZeRO-3's pieces while recomputing),
a loss function recomputed whole; or ``remat=auto``: one Rotor schedule over the blocks within the
activation budget (with a pipe axis: over one stage's blocks, for one microbatch, run by every stage),
solved on shapes for each batch shape the step sees."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random, tree as tree_util
from cfx._src.models.function import LossModel
from cfx._src.models.parts import hook, parts_of
from cfx._src.plan.strategy import Built, Strategy
from cfx._src.remat import policies as cp
from cfx._src.remat.chained import Chained
from cfx._src.remat.engine import remat
from cfx._src.remat.plan import solve as solve_remat
from cfx._src.transforms.shapes import eval_shape

POLICIES = {"blocks": cp.nothing_saveable, "dots": cp.dots_saveable}


def remat_blocks(model: Any, mode: str) -> Any:
    """``model`` with every block under ``cfx.remat``: ``blocks`` keeps only each block's input,
    ``dots`` also its matmul outputs; ``none`` returns the model. A loss function without blocks
    (``LossModel``) is checkpointed whole."""
    if mode not in POLICIES:
        return model
    if isinstance(model, LossModel):
        return dataclasses.replace(model, loss_fn=remat(model.loss_fn, policy=POLICIES[mode]))
    return model.map_blocks(lambda b: remat(b, policy=POLICIES[mode]))


class Remat(Strategy):
    name = "remat"

    def check_plan(self, plan) -> None:
        if (plan.remat == "auto") != (plan.remat_budget is not None):
            raise ValueError("Plan: remat=auto needs an activation budget (remat=auto:512MiB, or "
                             "--remat-budget) and only auto takes one.")

    def check(self, plan, model, where: str) -> None:
        if plan.remat != "auto":
            return
        if isinstance(model, LossModel):
            raise ValueError(f"{where}: remat=auto schedules a chain of blocks; the loss function {model.name!r} has "
                             "none. Use remat=blocks (the whole function recomputed in backward), or implement the "
                             "parts protocol.")
        if hook(model, "check_train_batch") is not None:
            raise ValueError(f"{where}: remat=auto solves its schedule on a token model's batch through its chain of "
                             f"blocks; {type(model).__name__} takes a batch of its own (and a UNet's blocks are no "
                             "chain: skip connections). Use remat=blocks or remat=dots.")

    def jit_refusal(self, plan) -> str | None:
        return "remat=auto runs its Rotor schedule through saved-tensor hooks" if plan.remat == "auto" else None

    def wrap_block(self, plan, block) -> Any:
        return remat(block, policy=POLICIES[plan.remat]) if plan.remat in POLICIES else block

    def wrap_chain(self, plan, model, schedule) -> Any:
        """A loss function recomputed whole (``blocks`` / ``dots``); ``remat=auto`` without a pipe axis:
        the model runs its blocks as one chain under ``schedule`` (a pipe axis's stages run it per stage:
        ``Pipe.runner`` passes it on)."""
        if isinstance(model, LossModel):
            return remat_blocks(model, plan.remat)
        if schedule is None or plan.has("pipe"):
            return model
        return Chained(model, schedule)

    def solve(self, plan, built: Built, tokens: torch.Tensor, key: Any) -> Any:
        """``remat=auto``: the fastest schedule whose activations fit the budget (Rotor), solved on one
        data rank's share of a batch like ``tokens`` of the unsharded model (tensor-parallel blocks then
        hold less); with a pipe axis one stage's blocks on one microbatch, the chain every stage runs."""
        if plan.remat != "auto":
            return None
        meta = tree_util.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"),
                             eval_shape(built.model.init, random.key(0)))
        axis = plan.sequence_axis  # one rank's rows and positions
        rows = tokens[:tokens.shape[0] // plan.size("data"), :tokens.shape[1] // (plan.size(axis) if axis else 1)]
        model = built.model
        if not plan.has("pipe"):
            return solve_remat(model, meta, rows, budget=plan.remat_budget, key=key)[1]
        k = len(model.blocks) // (plan.size("pipe") * plan.chunks)
        x = torch.empty((rows.shape[0] // plan.microbatches, rows.shape[1], parts_of(model, "Plan").width),
                        device="meta")
        return solve_remat([b.apply for b in model.blocks[:k]], meta["blocks"][:k], x, budget=plan.remat_budget)[1]
