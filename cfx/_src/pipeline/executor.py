"""``cfx.pipeline(model, schedule)``: run a schedule's actions on the ranks of a ``pipe`` axis.

``step = cfx.pipeline(model, schedule, axis="pipe")`` is a drop-in for
``cfx.value_and_grad(model.loss)`` inside ``cfx.shard_map``: ``loss, grads = step(params,
tokens, targets)``. Every rank gets the same (already data-sharded) batch and the whole params
tree (``P()`` over the pipe axis; tensor-parallel shards over ``model`` as usual). It splits the
batch into ``m = schedule.n_microbatches`` microbatches of ``b = B / m`` rows and runs *its*
action list in order, holding the stages ``partition`` gave it (virtual stage s on rank s % p):

  F       forward of stage s on microbatch j: embeddings (s = 0), its blocks, and for the last
          stage the head and the loss, scaled by j's share of the valid targets (1/m without
          ignored targets), so the losses add up to ``model.loss`` of the whole batch. The stage
          input is a fresh leaf; the output is sent and only its ``GradientEdge`` kept. Where the
          parts' ``block_loss`` says the blocks add terms of their own (Mixtral's routers), every
          stage adds its blocks' terms / m: the last into its loss, the others riding on their
          output into its backward (``run._WithLoss``), so each stage's own terms reach its params.
  B       backward of (s, j) given the received output gradient: input gradient (sent on) and
          parameter gradients (accumulated). I / W: the zero-bubble split (``backward.py``).
  SEND_*  point-to-point ``lax.collectives.send`` of an activation (b, T, C) or its gradient,
          tagged (family, stage, microbatch); never waits for the peer.
  RECV_*  the message, in a fresh (b, T, C) buffer; blocks until it arrived. Each receive is
          posted when the previous one is read, so the bytes move while the rank computes.

Returned values. ``loss``: the full-batch mean loss on every pipe rank (the last stage's sum,
all-reduced over the axis). ``grads``: shaped like ``params``. With ``sum_grads=True`` (default)
they are the full gradients on every pipe rank, equal to ``value_and_grad(model.loss)``: each
rank's contribution - its stages' gradients, zeros elsewhere, the tied head's two halves on the
first and the last stage's ranks - summed in one flat all-reduce over the axis (with the loss).
With ``sum_grads=False`` you get the contributions themselves (``psum`` over the axis completes
them) and save that all-reduce, e.g. to fuse it with your own reductions. ``step.loss(params, tokens,
targets)`` evaluates: only the schedule's forward actions and their messages, without grad.

Composes with DP (``tree_pmean`` the grads over ``data``), Megatron TP (pass
``tensor_parallel(model)``; activations between stages are replicated over ``model``) and remat
(``model.map_blocks(cfx.remat)``). Params and grads are whole trees on every pipe rank: the
pipeline splits compute and activations, not parameter memory. Dropout is off (no key).

Memory and time. While a ``cfx.memory`` tracker is active, the tensors autograd saves for a
pending backward (outside ``cfx.remat`` regions, whose hooks take precedence) and the stage
inputs are watched as kind ``"activation"``: freed by B, or by W for a split backward (I keeps
what W needs). Every action's start and end go to active ``cfx.pipeline.trace()`` collectors.
All checks (schedule, stages vs blocks, the axis and its size, batch divisibility, inputs) run
on every rank before any message.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.lax import collectives as lax
from cfx._src.mesh import context as ctx_lib
from cfx._src.models.common import check_params
from cfx._src.pipeline.partition import ModelParts, Partition, model_parts, partition
from cfx._src.pipeline.run import WHERE, Run
from cfx._src.pipeline.schedule import Schedule
from cfx._src.pipeline.validate import validate


def pipeline(model: Any, schedule: Schedule, *, axis: str = "pipe", plan: Partition | None = None,
             sum_grads: bool = True, local_blocks: bool = False, chain: Any = None,
             fp8_sends: bool = False) -> "PipelineStep":
    """A ``step(params, tokens, targets) -> (loss, grads)`` running ``schedule`` over ``axis``.

    ``plan`` (default ``partition(model, schedule.n_stages)``) says which blocks each stage runs.
    ``local_blocks``: ``params["blocks"]`` holds only this rank's blocks (its stages in order, see
    ``PipelineStep.held_blocks``) and so do the returned grads, whose block entries are then this
    rank's own (not summed over the axis): stages keep only their own blocks' params and grads.
    ``chain``: a ``cfx.remat.solve`` plan for a chain of one stage's blocks, under which every
    stage runs its blocks (activation checkpointing solved per stage; a split backward's I then
    computes the weight gradients too, and W hands them over). ``fp8_sends``: activations go to the
    next stage as their e4m3 casts with their scale (``messages.packed``), gradients as they are. Raises ``ValueError`` /
    ``ScheduleError`` here for a bad schedule or plan; the mesh-dependent checks run in the step,
    on every rank, before any communication.
    """
    if not isinstance(schedule, Schedule):
        raise ValueError(f"{WHERE}: schedule must be a Schedule (e.g. cfx.pipeline.one_f_one_b(p, "
                         f"m)), got {type(schedule).__name__}.")
    validate(schedule)
    parts = model_parts(model)
    plan = partition(model, schedule.n_stages) if plan is None else plan
    if plan.n_stages != schedule.n_stages or plan.bounds[-1] != len(model.blocks):
        raise ValueError(f"{WHERE}: the plan has {plan.n_stages} stages over {plan.bounds[-1]} "
                         f"blocks; the schedule needs {schedule.n_stages} stages (p*v) over the "
                         f"model's {len(model.blocks)}. Make it with partition(model, "
                         f"{schedule.n_stages}).")
    if chain is not None and parts.block_loss is not None:
        raise ValueError(f"{WHERE}: {type(model).__name__}'s blocks add terms to the loss (ModelParts.block_loss), "
                         "which a cfx.remat.solve chain does not return; remat per block instead "
                         "(model.map_blocks(cfx.remat)).")
    if chain is not None:
        sizes = {len(plan.blocks(s)) for s in range(plan.n_stages)}
        if sizes != {chain.chain.n}:
            raise ValueError(f"{WHERE}: the remat plan is for a chain of {chain.chain.n} blocks but the "
                             f"stages run {sorted(sizes)}; solve it for one stage's blocks.")
    return PipelineStep(model, schedule, axis, plan, parts, bool(sum_grads), bool(local_blocks), chain, bool(fp8_sends))


@dataclasses.dataclass(frozen=True)
class PipelineStep:
    """The step ``pipeline`` returns; ``schedule`` and ``plan`` say what it runs."""

    model: Any
    schedule: Schedule
    axis: str
    plan: Partition
    parts: ModelParts
    sum_grads: bool
    local_blocks: bool = False
    chain: Any = None  # a remat plan each stage runs its blocks under
    fp8_sends: bool = False  # activations sent as their e4m3 casts (``messages.packed``)

    def held_blocks(self, rank: int) -> list[int]:
        """The blocks pipe rank ``rank`` runs, its stages in ascending order."""
        return [i for s in self.schedule.stages_of(rank) for i in self.plan.blocks(s)]

    def __call__(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *,
                 scale: torch.Tensor | float | None = None):
        """``(loss, grads)``; with ``scale`` (fp16 loss scaling) the grads are those of
        ``loss * scale`` and the loss is returned unscaled."""
        ctx = self._check(params, tokens, targets)
        run = Run(self, params, tokens, targets, ctx.coords[self.axis])
        run.scale = scale
        run.execute(ctx)
        return run.results()

    def loss(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The full-batch mean loss on every pipe rank, forward only: the schedule's F actions and
        their messages, without grad (an evaluation; no backward, no activations kept)."""
        ctx = self._check(params, tokens, targets)
        with torch.no_grad():
            run = Run(self, params, tokens, targets, ctx.coords[self.axis], forward_only=True)
            run.execute(ctx)
        return lax.psum(run.loss, self.axis)

    def _check(self, params, tokens, targets) -> ctx_lib.RankContext:
        ctx = ctx_lib.current_or_none()
        p, m = self.schedule.n_ranks, self.schedule.n_microbatches
        if ctx is None:
            raise ValueError(f"{WHERE}: the step must run inside cfx.shard_map over a mesh with a "
                             f"{self.axis!r} axis of size {p}; it was called outside any mesh.")
        if self.axis not in ctx.mesh.shape:
            raise ValueError(f"{WHERE}: {ctx.mesh!r} has no {self.axis!r} axis (axes "
                             f"{list(ctx.mesh.axis_names)}); add {self.axis!r}: {p} to the mesh or "
                             f"pass axis= one of its axes.")
        if ctx.mesh.shape[self.axis] != p:
            raise ValueError(f"{WHERE}: schedule {self.schedule.name!r} is for {p} ranks but axis "
                             f"{self.axis!r} of {ctx.mesh!r} has {ctx.mesh.shape[self.axis]}; build "
                             f"the schedule with p={ctx.mesh.shape[self.axis]}.")
        self.parts.check(tokens, targets)
        if tokens.shape[0] % m:
            raise ValueError(f"{WHERE}: this rank's batch of {tokens.shape[0]} rows does not split "
                             f"into the schedule's {m} microbatches; use a per-rank batch that is a "
                             f"multiple of {m} or a schedule with a divisor of it.")
        if self.parts.check_microbatch is not None:
            self.parts.check_microbatch((tokens.shape[0] // m, *tokens.shape[1:]))
        if self.local_blocks:
            held = len(self.held_blocks(ctx.coords[self.axis]))
            if not isinstance(params.get("blocks"), list) or len(params["blocks"]) != held:
                raise ValueError(f"{WHERE}(local_blocks=True): pipe rank {ctx.coords[self.axis]} runs {held} "
                                 "blocks; pass exactly those as params['blocks'] (held_blocks(rank)).")
        else:
            check_params(WHERE, self.model, params)
        return ctx


