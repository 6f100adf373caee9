"""What every exchange between ranks rests on: a rank's group over named axes (``Axes``), the
accounting of each call in the active ``comm_stats`` collectors, and the buffers handed to the
backend.

Blocks are exchanged in the *requested* axis order: a group is made once per member set in the
mesh's axis order, and ``Axes.order`` maps requested positions to group ranks.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from cfx._src.core import context
from cfx._src.mesh import memory
from cfx._src.mesh import context as ctx_lib

T = TypeVar("T")

collectors = context.Collectors("cfx_comm_stats")  # the active cfx.comm_stats() (lax.stats)


class Axes:
    """A rank's view of the group over ``axes`` in the requested order (make it with ``axes``).

    The group is made (a rendezvous of its members) when the ``Axes`` is, so that a rank that
    fails later has joined it and its peers fail fast; while ``torch.compile`` traces a rank's
    code an ``Axes`` is pure data about the mesh (names, size, this rank's index) and the group
    is made when the graph first moves bytes (``group=False``).
    """

    def __init__(self, axes: tuple[str, ...], where: str, *, group: bool = True):
        ctx = ctx_lib.current(where)
        self.where = where
        self.names = ctx.mesh.check_axes(axes, where)
        self.ctx = ctx
        self.key = ",".join(self.names)  # how a compiled graph's collective names its axes
        self.size = ctx.mesh.axes_size(self.names)
        self.index = ctx.mesh.index_in(self.names, ctx.coords)  # position in requested order: see index_of
        canon = tuple(a for a in ctx.mesh.axis_names if a in self.names)  # the group's axis order
        self._group = ctx.group(self.names) if group else None
        # order[i]: the group rank of the member at requested position i
        if canon == self.names:
            self.order = None
        else:
            self.order = [self._canon_index(i, canon) for i in range(self.size)]

    @property
    def group(self) -> ctx_lib.Group:
        if self._group is None:
            self._group = self.ctx.group(self.names)
        return self._group

    def _canon_index(self, i: int, canon: tuple[str, ...]) -> int:
        mesh, c = self.ctx.mesh, {}
        for a in reversed(self.names):
            i, c[a] = divmod(i, mesh.shape[a])
        return mesh.index_in(canon, c)

    def group_rank(self, position: int) -> int:
        """The group rank of the member at requested ``position``."""
        return position if self.order is None else self.order[position]

    def in_group_order(self, by_position: Sequence[T]) -> list[T]:
        """``by_position`` (one item per requested position) by group rank, as the backend takes it."""
        if self.order is None:
            return list(by_position)
        out = [None] * self.size
        for i, j in enumerate(self.order):
            out[j] = by_position[i]
        return out

    def record(self, op: str, *ts: torch.Tensor) -> None:
        """Count one collective moving ``ts`` with the active ``cfx.comm_stats`` collectors."""
        active = collectors.active()
        if not active:
            return
        numel, nbytes = sum(t.numel() for t in ts), sum(t.numel() * t.element_size() for t in ts)
        for c in active:
            c.record(self.ctx.rank, op, self.names, numel, nbytes, ctx_lib.in_backward())


def axes(names: tuple[str, ...], where: str) -> Axes:
    """This rank's ``Axes`` over ``names``; under ``torch.compile`` computed once while tracing and
    kept in the graph as a constant (a rank's code is compiled for that rank, see ``cfx.jit``)."""
    if torch.compiler.is_dynamo_compiling():
        return _axes_while_tracing(tuple(names), where)
    return Axes(tuple(names), where)


@context.constant_result
def _axes_while_tracing(names: tuple[str, ...], where: str) -> Axes:
    return Axes(names, where, group=False)  # run for real by dynamo: reads this thread's rank context


def index_of(ax: Axes) -> int:
    """``ax.index`` for code that computes with it: a graph that reads it while tracing is this
    rank's index (``cfx.jit`` then compiles one per index; ``context.note_axis_index``)."""
    if torch.compiler.is_dynamo_compiling():
        context.note_axis_index(ax.names, ax.index)
    return ax.index


def backend_buffers(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The buffers handed to the backend: the tensors themselves, or private copies while a
    ``cfx.memory`` tracker is active (``copy_back`` then copies what the backend wrote).

    Gloo signals completion before its worker thread drops its references to the tensors it
    moved, so a buffer (and any storage it shares with the caller) can outlive the call by a
    thread switch. Tracked memory must not depend on thread timing, so under a tracker the
    backend only ever sees untracked copies, and results are copied into tracked tensors.
    """
    if not memory.is_tracking():
        return list(tensors)
    with memory.ops_unwatched():
        return [t.clone() for t in tensors]


def copy_back(outs: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor]) -> None:
    """Each output given what the backend wrote into its buffer (``backend_buffers``)."""
    for o, b in zip(outs, bufs):
        if o is not b:
            o.copy_(b)
