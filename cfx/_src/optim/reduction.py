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

A tree stepped in parts one after another (Gemini's chunks, streamed from host or NVMe) gives
each part ``rest_sq``, the sum of squares of everything else in the whole tree (every part,
every rank), and ``rest_bad``, its count of inf/nan: the whole-tree norm and the finiteness
check then see the whole tree while the part alone is in memory. Where the parts are not the
params' leaves (flat chunks), ``no_leaf_norms`` says so, and a per-leaf norm raises it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import torch

from cfx._src.core import context


@dataclasses.dataclass(frozen=True)
class Sharding:
    leaf_axes: tuple[tuple[str, ...], ...]
    total_axes: tuple[tuple[str, ...], ...]
    every: tuple[str, ...]
    psum: Callable[[torch.Tensor, tuple[str, ...]], torch.Tensor]
    rest_sq: torch.Tensor | None = None   # the rest of the whole tree's sum of squares
    rest_bad: torch.Tensor | None = None  # the rest of the whole tree's count of inf/nan
    no_leaf_norms: str | None = None      # why the leaves seen are not the params' own (no per-leaf norms)


_current: context.Var[Sharding | None] = context.Var("cfx_optim_sharding", None, semantic="cfx.optim.sharded")


@contextlib.contextmanager
def sharded(leaf_axes: Sequence[Sequence[str]], *, every: Sequence[str], psum,
            total_axes: Sequence[Sequence[str]] | None = None, rest_sq: torch.Tensor | None = None,
            rest_bad: torch.Tensor | None = None, no_leaf_norms: str | None = None):
    """Norms and finiteness checks inside the block span the mesh (module doc)."""
    leaf = tuple(tuple(a) for a in leaf_axes)
    total = leaf if total_axes is None else tuple(tuple(a) for a in total_axes)
    token = _current.set(Sharding(leaf, total, tuple(every), psum, rest_sq, rest_bad, no_leaf_norms))
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
    if not total and s.no_leaf_norms:
        raise ValueError(f"{where}: per-leaf norms (LAMB / LARS trust ratios) need the params' own leaves, "
                         f"but {s.no_leaf_norms}.")
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
    """``n`` (a 0-d count, e.g. of inf/nan) summed over every axis of the sharded step (and the
    rest of a tree stepped in parts)."""
    s = _current.get()
    if s is None:
        return n
    n = s.psum(n, s.every) if s.every else n
    return n if s.rest_bad is None else n + s.rest_bad.to(n.dtype)


def add_rest(sq: torch.Tensor) -> torch.Tensor:
    """A whole-tree sum of squares ``sq`` plus the rest of a tree stepped in parts."""
    s = _current.get()
    return sq if s is None or s.rest_sq is None else sq + s.rest_sq.to(sq.dtype)
