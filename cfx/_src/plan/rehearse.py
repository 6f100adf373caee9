"""A Plan's step rehearsed on shapes, before any rank exists.

Every rank's step body (``Program._body``: forward, backward, pipeline messages, ZeRO's gathers
and reduce-scatters, the optimizer) runs on fake tensors, one rank after another, in that rank's
context over process groups that move nothing. So the step's own code says what each rank
sends -- every collective's op, axes, payload and phase (``cfx.comm_stats``' records) -- and
what it holds while computing: the peak bytes of op outputs and saved tensors (``cfx.memory``'s
op tracking), nothing allocated or computed. Ranks run alone, so a receive returns at once: the
figures are per rank and per step, not a timeline.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.lax.stats import CommRecord, comm_stats
from cfx._src.mesh.layout import block_shape
from cfx._src.mesh.context import Group, RankContext, installed
from cfx._src.mesh.spec import is_spec
from cfx._src.plan.protocol import TrainState


class _Done:
    """A finished request."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _DryGroup:
    """A process group that moves nothing (its tensors are fake: there are no values to move)."""

    def _call(self, *args, **kwargs) -> _Done:
        return _Done()

    allreduce = allgather = _reduce_scatter_base = alltoall_base = send = recv = _call


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """One rank's step on shapes: its collectives and its peak bytes beyond the model state."""

    rank: int
    records: tuple[CommRecord, ...]
    activations: int  # peak bytes of op outputs and saved tensors while the step runs


def rehearse(program, body, rows: int, seq: int, rank: int) -> Rehearsal:
    """Rank ``rank``'s step of ``program`` on a global batch of ``rows`` x ``seq`` tokens, ``body``
    its step body for that batch (``Program.body_for``)."""
    mesh, layout = program.mesh, program.layout
    coords = mesh.coords(rank)
    dry = _DryGroup()
    ctx = RankContext(mesh, rank, coords,
                      lambda axes: Group(axes, mesh.axes_size(axes), mesh.index_in(axes, coords), dry))
    with installed(ctx), FakeTensorMode(allow_non_fake_inputs=True):
        params = _stored_blocks(layout, mesh)
        opt_state = program.opt.init(layout.local_view(params) if layout.opt_on_local else params)
        tokens = torch.zeros(block_shape((rows, seq), layout.batch_spec, mesh), dtype=torch.long)
        with comm_stats() as stats, memory.track() as mem, mem.track_ops("device"):
            body(TrainState(params, opt_state), (tokens, tokens), None)
        peak = mem.peak_by_kind("device", rank=rank).get("activation", 0)
    return Rehearsal(rank, tuple(stats.records), peak)


def _stored_blocks(layout, mesh) -> Any:
    """One rank's blocks of the stored params, as (fake) zeros."""
    if layout.zero3:  # the rank's pieces, stacked per stage like the stored layout
        return layout.stack_local(tree_util.map(lambda x: torch.zeros(x.shape, dtype=x.dtype),
                                                layout.local_abstract().pieces))
    specs = tree_util.leaves(layout.specs, is_leaf=is_spec)
    leaves, treedef = tree_util.flatten(layout.shapes)
    return tree_util.unflatten(treedef, [torch.zeros(block_shape(x.shape, s, mesh), dtype=x.dtype)
                                         for x, s in zip(leaves, specs)])
