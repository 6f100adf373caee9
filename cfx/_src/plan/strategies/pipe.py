"""Pipeline stages over ``pipe``: each rank stores and runs only its own blocks (``Layout`` stacks
every stage's blocks), the batch runs as the schedule's microbatches (``cfx.pipeline``), and the
gradients accumulate over them and leave the pipeline once per step."""
from __future__ import annotations

import dataclasses
from typing import Any

from cfx._src.models.function import LossModel
from cfx._src.models.parts import hook, parts_of
from cfx._src.pipeline import schedule as schedules
from cfx._src.pipeline.executor import pipeline
from cfx._src.plan.layout import stored_order
from cfx._src.plan.strategy import Built, Strategy
from cfx._src.zero.params import ZeroParams


GENERATORS = {"gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved": "interleaved_1f1b", "zb-h1": "zb_h1"}


def check_schedule(name: str, pipe: int, microbatches: int, chunks: int) -> None:
    """ValueError where ``make_schedule`` would refuse these, without building the schedule."""
    if name not in GENERATORS:
        raise ValueError(f"schedule {name!r}: expected gpipe, 1f1b, interleaved or zb-h1.")
    schedules.check_sizes(GENERATORS[name], pipe, microbatches, chunks if name == "interleaved" else 1)


def make_schedule(name: str, pipe: int, microbatches: int, chunks: int) -> schedules.Schedule:
    """The pipeline schedule named ``name`` for ``pipe`` ranks."""
    check_schedule(name, pipe, microbatches, chunks)
    build = getattr(schedules, GENERATORS[name])
    return build(pipe, microbatches, chunks) if name == "interleaved" else build(pipe, microbatches)


class Pipe(Strategy):
    name, axes = "pipe", ("pipe",)

    def check_plan(self, plan) -> None:
        if not plan.has("pipe"):
            if plan.microbatches != 1 or plan.chunks != 1 or plan.schedule != "1f1b":
                raise ValueError("Plan: schedule / microbatches / chunks describe a pipeline; the mesh "
                                 f"{dict(plan.mesh)} has no pipe axis. Add pipe=N or drop them.")
        elif plan.chunks > 1 and plan.schedule != "interleaved":
            raise ValueError(f"Plan: chunks={plan.chunks} (virtual stages per rank) needs "
                             f"schedule=interleaved, not {plan.schedule}.")

    def check(self, plan, model, where: str) -> None:
        if not plan.has("pipe"):
            return
        if isinstance(model, LossModel):
            raise ValueError(f"{where}: the pipe axis cuts a model into stages of blocks; the loss function "
                             f"{model.name!r} has none. Implement the parts protocol (cfx.models.ChainModel: blocks, "
                             "map_blocks, parts(); the README's 'Your own model' section), or drop pipe=.")
        try:  # the stages' parts, if they carry what its loss needs (Mixtral's aux losses)
            parts_of(model, f"{where} (pipe axis)")
        except ValueError as e:
            raise ValueError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None
        if getattr(hook(model, "config"), "dropout", 0.0) > 0:
            raise ValueError(f"{where}: pipeline stages run without dropout; build the model with dropout=0.")
        stored_order(len(model.blocks), plan.size("pipe"), plan.chunks, type(model).__name__)
        check_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)

    def place_frozen(self, plan, placer, model) -> Any:
        """Each block's frozen weights held by the stage that runs it (the stored order's stages)."""
        if not plan.has("pipe") or not isinstance(getattr(model, "blocks", None), tuple):
            return placer
        p = plan.size("pipe")
        order = stored_order(len(model.blocks), p, plan.chunks, type(model).__name__)
        rows = len(order) // p
        return dataclasses.replace(placer, stages=tuple(tuple(order[c * rows:(c + 1) * rows]) for c in range(p)))

    def jit_refusal(self, plan) -> str | None:
        return "a pipe axis runs its schedule's sends and receives eagerly" if plan.has("pipe") else None

    def runner(self, plan, inner: Any, built: Built) -> Any:
        if not plan.has("pipe"):
            return inner
        sched = make_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)
        return StagesRunner(pipeline(built.local, sched, local_blocks=True, chain=built.schedule,
                                     fp8_sends="pipe" in plan.fp8_comm.split("+")))


class StagesRunner:
    """A rank's loss and gradients through the pipeline's schedule (its stages' blocks); under ZeRO-3
    the stages gather their own pieces and return the pieces' gradients."""

    def __init__(self, step: Any):
        self.step = step

    def grads(self, local: Any, batch: tuple, key: Any, scale: Any, view: Any) -> tuple[Any, Any]:
        del key  # stages run without dropout (checked)
        tree = view(local)  # cast; under ZeRO-3 a ZeroParams, or a placement's ShardedLeaf tree already
        if isinstance(tree, ZeroParams):
            tree = tree.sharded_leaves()
        loss, grads = self.step(tree, *batch, scale=scale)
        return loss, ZeroParams(grads, local.shapes, local.n) if isinstance(local, ZeroParams) else grads

    def loss(self, local: Any, batch: tuple) -> Any:
        """The schedule's forward half on ``local`` (cast already)."""
        return self.step.loss(local.sharded_leaves() if isinstance(local, ZeroParams) else local, *batch)
