"""Norms and inf/nan checks of a tree that is one rank's part of a bigger one -- the one
global-norm mechanism of clipping, LAMB / LARS trust ratios and the fp16 loss scaler.

Inside a sharded step each rank's optimizer sees its own blocks. The step says how they add up::

    with cfx.optim.sharded(leaf_axes, every=mesh_axes, psum=cfx.lax.psum):
        updates, state = tx.update(grads, state, params)

``leaf_axes[i]``: the mesh axes leaf ``i`` (in the params' flatten order) is split over -- its
own norm (LAMB, LARS) ``psum``s its sum of squares over them, and only them (a replicated leaf
counts once); ``total_axes[i]`` (default: the same) adds the axes over which *other ranks hold
other leaves* in its place (a pipeline stage's blocks: ``pipe``), for the norm of the whole tree
(clipping); ``every``: the axes over which an inf/nan anywhere must skip the step everywhere.
Without the context everything is local, as on one device.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Sharding:
    leaf_axes: tuple[tuple[str, ...], ...]
    total_axes: tuple[tuple[str, ...], ...]
    every: tuple[str, ...]
    psum: Callable[[torch.Tensor, tuple[str, ...]], torch.Tensor]


_current: contextvars.ContextVar[Sharding | None] = contextvars.ContextVar("cfx_optim_sharding", default=None)


@contextlib.contextmanager
def sharded(leaf_axes: Sequence[Sequence[str]], *, every: Sequence[str], psum,
            total_axes: Sequence[Sequence[str]] | None = None):
    """Norms and finiteness checks inside the block span the mesh (module doc)."""
    leaf = tuple(tuple(a) for a in leaf_axes)
    total = leaf if total_axes is None else tuple(tuple(a) for a in total_axes)
    token = _current.set(Sharding(leaf, total, tuple(every), psum))
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def local():
    """Norms and checks see only the tree given (a transformation that already accounts for the
    rest of the mesh itself, like ZeRO's ghost leaf)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def is_sharded() -> bool:
    return _current.get() is not None


def leaf_sq_sums(sq: torch.Tensor, idx: Sequence[int], n_leaves: int, where: str, *,
                 total: bool = False) -> torch.Tensor:
    """Per-leaf sums of squares ``sq`` (k,) of leaves ``idx`` (of ``n_leaves``), summed over the
    axes that split each leaf (``total``: and over those where other ranks hold other leaves in
    its place, so that the entries add up to the whole tree's): one ``psum`` per set of axes."""
    s = _current.get()
    if s is None:
        return sq
    if n_leaves != len(s.leaf_axes):
        raise ValueError(f"{where}: the tree has {n_leaves} leaves but the sharded step's params have "
                         f"{len(s.leaf_axes)}; norms across shards need a tree shaped like the params.")
    axes_of = s.total_axes if total else s.leaf_axes
    groups: dict[tuple[str, ...], list[int]] = {}
    for j, i in enumerate(idx):
        groups.setdefault(axes_of[i], []).append(j)
    out = sq
    for axes, pos in groups.items():
        if axes:
            where_ = torch.tensor(pos, device=sq.device)
            out = out.index_copy(0, where_, s.psum(sq.index_select(0, where_), axes))
    return out


def count_everywhere(n: torch.Tensor) -> torch.Tensor:
    """``n`` (a 0-d count, e.g. of inf/nan) summed over every axis of the sharded step."""
    s = _current.get()
    return s.psum(n, s.every) if s is not None and s.every else n
