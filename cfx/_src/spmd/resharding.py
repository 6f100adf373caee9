"""Layout conversion: the cheapest sequence of collectives from one spec to another.

A layout is, per tensor dimension, the ordered tuple of mesh axes splitting it (major to minor)
plus the axes over which blocks are partial sums. Moves (per-rank bytes sent, ring algorithms):

* ``split(a, d)``        an unused axis becomes the minor split of dim ``d``: a local slice, 0 bytes
* ``all_gather(a, d)``   drop the minor axis ``a`` of dim ``d``: ``(n-1) * block`` bytes
* ``all_to_all(a, d, e)`` move minor axis ``a`` from dim ``d`` to dim ``e``: ``(n-1)/n * block``
* ``psum(a)``            reduce a partial axis: ``2 (n-1)/n * block``
* ``psum_scatter(a, d)`` reduce a partial axis into the minor split of ``d``: ``(n-1)/n * block``

Dijkstra over layouts finds the cheapest path (Colossal-AI's shape-consistency manager does a
greedy version of this search); ``naive_bytes`` is the cost of gathering everything and then
splitting, for comparison. ``run_steps`` carries a rank's block along a plan (``shard_map`` does
it for every argument whose layout differs from its in_spec; ``cfx.reshard`` is built on that).
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any

import torch

from cfx._src.lax import comm, groups
from cfx._src.mesh.spec import P

Layout = tuple[tuple[tuple[str, ...], ...], frozenset]


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    axis: str
    dim: int | None = None
    to_dim: int | None = None
    nbytes: float = 0.0

    def __str__(self) -> str:
        where = "" if self.dim is None else f" dim {self.dim}" + ("" if self.to_dim is None else f"->{self.to_dim}")
        return f"{self.op}({self.axis}{where}): {self.nbytes:,.0f} B"


@dataclasses.dataclass(frozen=True)
class ReshardPath:
    src: P
    dst: P
    steps: tuple[Step, ...]
    nbytes: float        # per rank, this plan
    naive_bytes: float   # per rank, gather everything then split

    def __str__(self) -> str:
        lines = [f"reshard {self.src!r} -> {self.dst!r}: {self.nbytes:,.0f} B per rank "
                 f"(gather-then-split: {self.naive_bytes:,.0f} B)"]
        lines += [f"  {s}" for s in self.steps] or ["  (no communication)"]
        return "\n".join(lines)


def _layout(spec: P, ndim: int, partial=()) -> Layout:
    return tuple(spec.axes_of(d) for d in range(ndim)), frozenset(partial)


def _to_spec(dims) -> P:
    entries = [d if d else None for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _moves(state: Layout, shape, mesh, itemsize):
    dims, partial = state
    used = {a for d in dims for a in d} | partial
    block = itemsize * math.prod(shape) / math.prod(mesh.shape[a] for d in dims for a in d)

    def fits(d, extra):
        return shape[d] % (math.prod(mesh.shape[a] for a in dims[d]) * mesh.shape[extra]) == 0

    def put(d, new):
        return dims[:d] + (new,) + dims[d + 1:]
    for d, axes in enumerate(dims):
        if axes:
            a, n = axes[-1], mesh.shape[axes[-1]]
            yield Step("all_gather", a, d, nbytes=block * (n - 1)), (put(d, axes[:-1]), partial)
            for e in range(len(dims)):
                if e != d and fits(e, a):
                    nd = put(d, axes[:-1])
                    nd = nd[:e] + (nd[e] + (a,),) + nd[e + 1:]
                    yield Step("all_to_all", a, d, e, nbytes=block * (n - 1) / n), (nd, partial)
    for a in mesh.axis_names:
        if a in used:
            continue
        for d in range(len(dims)):
            if fits(d, a):
                yield Step("split", a, d), (put(d, dims[d] + (a,)), partial)
    for a in partial:
        n = mesh.shape[a]
        yield Step("psum", a, nbytes=2 * block * (n - 1) / n), (dims, partial - {a})
        for d in range(len(dims)):
            if fits(d, a):
                yield Step("psum_scatter", a, d, nbytes=block * (n - 1) / n), (put(d, dims[d] + (a,)), partial - {a})


def _naive_bytes(src: Layout, dst: Layout, shape, mesh, itemsize) -> float:
    """Gather every split axis (minor first) and reduce every partial, then slice locally."""
    dims, partial = [list(d) for d in src[0]], set(src[1])
    total = 0.0
    for a in sorted(partial):
        block = itemsize * math.prod(shape) / math.prod(mesh.shape[x] for d in dims for x in d)
        total += 2 * block * (mesh.shape[a] - 1) / mesh.shape[a]
    for d in dims:
        while d:
            block = itemsize * math.prod(shape) / math.prod(mesh.shape[x] for dd in dims for x in dd)
            total += block * (mesh.shape[d.pop()] - 1)
    return total


def find_path(src: P, dst: P, shape: tuple[int, ...], mesh, *, itemsize: int = 4,
         partial: tuple[str, ...] = ()) -> ReshardPath:
    """The cheapest sequence of collectives taking ``src`` (+ partial axes) to ``dst``."""
    start, goal = _layout(src, len(shape), partial), _layout(dst, len(shape))
    best = {start: 0.0}
    heap = [(0.0, 0, start, ())]
    tick = 0
    while heap:
        cost, _, state, steps = heapq.heappop(heap)
        if state == goal:
            return ReshardPath(src, dst, steps, cost, _naive_bytes(start, goal, shape, mesh, itemsize))
        if cost > best.get(state, math.inf):
            continue
        for step, nxt in _moves(state, shape, mesh, itemsize):
            c = cost + step.nbytes
            if c < best.get(nxt, math.inf) - 1e-9:
                best[nxt] = c
                tick += 1
                heapq.heappush(heap, (c, tick, nxt, steps + (step,)))
    raise ValueError(f"cfx.reshard: no sequence of collectives takes {src!r} to {dst!r} for shape "
                     f"{shape} on {mesh!r} (a dimension is not divisible by its axes?).")


class _Relayout(torch.autograd.Function):
    """One step of a layout change on a rank's block. Its transpose is the inverse step on the
    cotangent (a global value's cotangent is laid out like it): not the transpose of the
    ``cfx.lax`` collective it uses, whose result is typed as varying per rank."""

    @staticmethod
    def forward(ctx, x, step, ax):
        ctx.step, ctx.ax = step, ax
        return _apply(x, step, ax)

    @staticmethod
    def backward(ctx, g):
        s, ax = ctx.step, ctx.ax
        if s.op == "split":                      # slice <- all-gather
            out = torch.cat(comm.all_gather_blocks(g, ax), s.dim)
        elif s.op == "all_gather":               # all-gather <- this rank's slice
            out = g.chunk(ax.size, s.dim)[groups.index_of(ax)].contiguous()
        elif s.op == "all_to_all":               # all-to-all <- all-to-all back
            out = torch.cat(comm.all_to_all_blocks(g.chunk(ax.size, s.dim), ax), s.to_dim)
        elif s.op == "psum":                     # reduce partial sums <- the same cotangent everywhere
            out = g
        else:                                    # psum_scatter <- all-gather
            out = torch.cat(comm.all_gather_blocks(g, ax), s.dim)
        return out, None, None


def _apply(x: torch.Tensor, s: Step, ax: groups.Axes) -> torch.Tensor:
    if s.op == "split":
        return x.chunk(ax.size, s.dim)[groups.index_of(ax)].contiguous()
    if s.op == "all_gather":
        return torch.cat(comm.all_gather_blocks(x, ax), s.dim)
    if s.op == "all_to_all":
        return torch.cat(comm.all_to_all_blocks(x.chunk(ax.size, s.to_dim), ax), s.dim)
    if s.op == "psum":
        return comm.all_reduce(x, ax, "sum")
    if s.op == "psum_scatter":
        return comm.reduce_scatter_blocks(x.chunk(ax.size, s.dim), ax)
    raise AssertionError(s.op)


def run_steps(x: torch.Tensor, steps: tuple[Step, ...]) -> torch.Tensor:
    """A rank's block moved through ``steps`` (inside a rank; differentiable)."""
    for s in steps:
        ax = groups.axes((s.axis,), "cfx.reshard")
        x = _Relayout.apply(x, s, ax) if x.requires_grad and torch.is_grad_enabled() else _apply(x, s, ax)
    return x


@functools.lru_cache(maxsize=4096)
def same_layout(a: P, b: P, ndim: int) -> bool:
    """Whether ``a`` and ``b`` split an ``ndim``-dimensional array alike (asked per leaf at every
    shard_map boundary, of a few distinct specs)."""
    return a == b or _layout(a, ndim) == _layout(b, ndim)


def reshard_plan(arr: Any, spec: P) -> ReshardPath:
    return find_path(arr.spec, spec, arr.shape, arr.mesh, itemsize=arr.element_size(), partial=arr.partial)
