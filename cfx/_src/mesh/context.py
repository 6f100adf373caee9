"""Per-rank execution context: which mesh, rank and process groups the running code belongs to.

A shard_map body runs with a ``RankContext`` installed for its thread (``local`` backend: the
rank's worker thread; ``dist``: the process's own thread); ``cfx.lax`` collectives look their
groups up here. Nothing here is process-wide.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from cfx._src import context


class Group:
    """A process group for one ordered tuple of mesh axes, as seen by one rank.

    Holds the only strong reference to the torch ProcessGroup, so that dropping it on failure
    closes its sockets and fails peers blocked on this rank fast instead of at the timeout.
    """

    __slots__ = ("axes", "size", "rank", "pg")

    def __init__(self, axes: tuple[str, ...], size: int, rank: int, pg: Any):
        self.axes, self.size, self.rank, self.pg = axes, size, rank, pg

    def get(self) -> Any:
        if self.pg is None:
            raise RuntimeError(f"the process group for mesh axes {self.axes} was torn down after a "
                               "failure on another rank; this call cannot continue.")
        return self.pg


@dataclasses.dataclass
class RankContext:
    mesh: Any
    rank: int
    coords: dict[str, int]
    make_group: Callable[[tuple[str, ...]], Group]
    groups: dict[tuple[str, ...], Group] = dataclasses.field(default_factory=dict)

    def group(self, axes: tuple[str, ...]) -> Group:
        """The group over ``axes`` in the mesh's axis order (one group per member set)."""
        axes = tuple(a for a in self.mesh.axis_names if a in axes)
        g = self.groups.get(axes)
        if g is None:
            g = self.groups[axes] = self.make_group(axes)
        return g

    def drop_groups(self) -> None:
        for g in self.groups.values():
            g.pg = None
        self.groups.clear()


_current: context.Var[RankContext | None] = context.Var("cfx_rank", None, traced_as_constant=True)


def current(where: str) -> RankContext:
    ctx = _current.get()
    if ctx is None:
        raise ValueError(f"{where} names mesh axes, so it must run inside cfx.shard_map(f, mesh=...); "
                         "it was called outside any mesh.")
    return ctx


def current_or_none() -> RankContext | None:
    return _current.get()


def compile_key() -> tuple | None:
    """What a graph compiled here is specialised to: the mesh's axes and this rank (the rank's
    index along an axis is a constant of its graph); ``None`` outside shard_map bodies."""
    ctx = _current.get()
    return None if ctx is None else (tuple(ctx.mesh.shape.items()), ctx.rank)


@contextlib.contextmanager
def installed(ctx: RankContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
