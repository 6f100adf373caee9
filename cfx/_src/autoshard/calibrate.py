"""Measuring the cost model on a mesh: alpha-beta per mesh axis, and one rank's matmul throughput.

What the search charges is what is timed. For every mesh axis of more than one rank, every move in
``ops`` and every block size in ``sizes`` (the bytes a rank holds before the move), ``reshard.find_path``
is asked for the one-step plan making that move -- the step itself and the per-rank bytes the search
charges for it (``Step.nbytes``: ring figures, e.g. ``(n-1) * block`` for an all-gather, ``2 (n-1)/n *
block`` for a psum). Every rank then runs that step with ``reshard.run_steps`` inside one
``shard_map``: all ranks at once, after a barrier over the whole mesh, so an axis's groups share the
machine (cores, memory bandwidth, loopback) as they do in a real reshard. Each move is timed
``repeats`` times, interleaved with the others so drift in the machine's load is spread over all of
them. A rank's figure is its median; a step's time is the slowest rank's, taken with a ``pmax`` over
the mesh, so under ``dist`` (a process per rank, each timing its own) every rank fits the same model.

Per axis, ``seconds = alpha + beta * nbytes`` is fitted to those points by least squares on relative
error (each point weighted by 1/seconds, so the small steps that fix the latency count as much as
the large ones that fix the bandwidth, though they take 10-100x less time), constrained to ``alpha, beta >= 0`` (``fit``): ``latency = alpha``,
``bandwidth = 1 / beta``. Axes the mesh does not have (or of one rank) take the ``"*"`` entry: the
slowest measured axis.

Compute: every rank multiplies square fp32 matrices at once (``matmul`` rows: a few ms each), with
the intra-op threads its backend gives it -- ``local`` ranks are threads sharing this machine's
cores, one intra-op thread each where ranks outnumber cores -- so a rank's throughput is priced as
it runs beside its peers: ``flops_per_s = 2 matmul^3 / seconds``. Each timing spans a few products
back to back: a single one can finish before a peer waiting for the same core has started (then
every rank would see a whole core, e.g. 90 GFLOP/s where four ranks on two cores really get 25).
Median of three timings, slowest rank. Memory-bound ops (elementwise, norms, softmax): every rank
adds two 4 MiB vectors at once, ``memory_bandwidth`` = output bytes per second.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Sequence

import numpy as np
import torch

from cfx._src.spmd import resharding as reshard
from cfx._src.autoshard.cost import CostModel
from cfx._src.lax import comm, groups
from cfx._src.lax.collectives import pmax
from cfx._src.mesh.spec import P

KiB, MiB = 1 << 10, 1 << 20
OPS = ("all_gather", "psum", "psum_scatter", "all_to_all")
SIZES = (16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB)  # bytes a rank holds before a move
_ITEMSIZE = 4  # fp32
_WIDTH = 64    # an all_to_all block is (rows, n * _WIDTH): the moved columns are chunks of 64 floats
_ELEMENTWISE = 1 << 20  # floats per operand of the timed add (4 MiB)
_MM_BATCH = 4  # products per timing: one few-ms product can end before a peer sharing its core starts


@dataclasses.dataclass(frozen=True)
class Point:
    op: str          # a reshard move
    block: int       # bytes a rank holds before it
    nbytes: float    # bytes per rank the search charges for it (Step.nbytes)
    seconds: float   # slowest rank's median time


@dataclasses.dataclass(frozen=True)
class Timings:
    steps: dict[str, tuple[Point, ...]]   # per mesh axis of more than one rank
    matmul: int                           # rows of the square matmul
    matmul_s: float                       # slowest rank's median seconds per matmul
    elementwise_bytes: int = 0            # output bytes of the timed elementwise add
    elementwise_s: float = 0.0            # ... and its slowest rank's median seconds

    @property
    def flops_per_s(self) -> float:
        return 2 * self.matmul ** 3 / self.matmul_s

    @property
    def memory_bandwidth(self) -> float:
        return self.elementwise_bytes / self.elementwise_s if self.elementwise_s else CostModel.memory_bandwidth


def fit(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(alpha, beta) >= 0`` minimising ``sum((alpha + beta * x) / y - 1)^2`` (relative error).

    Two unknowns: the unconstrained solution if both are non-negative, else the better of the two
    one-sided fits (``alpha = 0`` or ``beta = 0``), which is where a non-negative optimum lies."""
    x, y = np.asarray(nbytes, np.float64), np.asarray(seconds, np.float64)
    if x.shape != y.shape or x.size < 2 or not (y > 0).all() or not (x >= 0).all():
        raise ValueError(f"calibrate.fit: needs at least two points with positive seconds and non-negative bytes "
                         f"(got bytes {x.tolist()}, seconds {y.tolist()}).")
    A = np.stack([1 / y, x / y], 1)  # (points, 2): rows weighted by 1/seconds; the target is all ones
    ones = np.ones_like(y)
    (alpha, beta), *_ = np.linalg.lstsq(A, ones, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)

    def one_sided(col: int) -> tuple[float, float]:
        a = A[:, col]
        coef = max(0.0, float(a @ ones / (a @ a))) if a @ a > 0 else 0.0
        return coef, float(np.sum((a * coef - ones) ** 2))
    (a0, ra), (b0, rb) = one_sided(0), one_sided(1)
    return (a0, 0.0) if ra <= rb else (0.0, b0)


def _check(mesh, sizes: Sequence[int], ops: Sequence[str], repeats: int, matmul: int) -> None:
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise ValueError(f"calibrate: unknown moves {bad}; choose from {list(OPS)}.")
    if repeats < 1 or matmul < 1:
        raise ValueError(f"calibrate: repeats={repeats} and matmul={matmul} must be at least 1.")
    if len(set(sizes)) < 2:
        raise ValueError(f"calibrate: sizes={list(sizes)} gives fewer than two block sizes; a line through "
                         "latency and bandwidth needs at least two (e.g. 16 KiB and 4 MiB).")
    for n in {mesh.shape[a] for a in mesh.axis_names}:
        grain = _ITEMSIZE * _WIDTH * n
        odd = [s for s in sizes if s % grain or s <= 0]
        if odd:
            raise ValueError(f"calibrate: block sizes {odd} bytes do not split over a {n}-rank axis of {mesh!r} "
                             f"into whole {_WIDTH}-float columns; use positive multiples of {grain} bytes.")


def _move(op: str, axis: str, block: int, mesh) -> tuple[reshard.Step, tuple[int, ...]]:
    """The one step of ``op`` on ``axis`` for a ``block``-byte rank block, and that block's shape."""
    n, k = mesh.shape[axis], block // _ITEMSIZE
    if op == "all_gather":
        src, dst, shape, partial, local = P(axis), P(), (n * k,), (), (k,)
    elif op == "psum":
        src, dst, shape, partial, local = P(), P(), (k,), (axis,), (k,)
    elif op == "psum_scatter":
        src, dst, shape, partial, local = P(), P(axis), (k,), (axis,), (k,)
    else:  # all_to_all: rows split -> columns split
        cols = n * _WIDTH
        src, dst, shape, partial, local = P(axis), P(None, axis), (n * k // cols, cols), (), (k // cols, cols)
    steps = reshard.find_path(src, dst, shape, mesh, itemsize=_ITEMSIZE, partial=partial).steps
    assert len(steps) == 1 and steps[0].op == op, steps
    return steps[0], local


def measure(mesh, *, sizes: Sequence[int] = SIZES,
            ops: Sequence[str] = OPS, repeats: int = 7, matmul: int = 512, progress: bool = False) -> Timings:
    """The timings ``calibrate`` fits (module doc), the same on every rank."""
    from cfx._src.spmd.arrays import device_get
    from cfx._src.spmd.shard_map import shard_map
    sizes = sorted(set(int(s) for s in sizes))
    _check(mesh, sizes, ops, repeats, matmul)
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    # (axis, op, block bytes, its reshard step, a rank's block shape)
    moves = [(a, op, s) + _move(op, a, s, mesh) for a in axes for op in ops for s in sizes]
    steps = [m[3] for m in moves]

    def body(_):
        everyone = groups.axes(tuple(mesh.axis_names), "cfx.autoshard.calibrate")
        say = progress and everyone.index == 0  # one rank reports
        tiny = torch.zeros(1)

        def barrier():
            comm.all_reduce(tiny, everyone, "sum")
        blocks = [torch.randn(local) for *_, local in moves]
        times = [[] for _ in moves]
        for block, step in zip(blocks, steps):  # warm-up: groups made, buffers touched
            reshard.run_steps(block, (step,))
        for r in range(repeats):
            if say:
                print(f"calibrate: collectives, round {r + 1}/{repeats}", file=sys.stderr, flush=True)
            for block, step, t in zip(blocks, steps, times):
                barrier()
                t0 = time.perf_counter()
                reshard.run_steps(block, (step,))
                t.append(time.perf_counter() - t0)
        del blocks
        if say:
            print(f"calibrate: {matmul}x{matmul} matmul on every rank", file=sys.stderr, flush=True)
        a, b = torch.randn(matmul, matmul), torch.randn(matmul, matmul)
        torch.mm(a, b)
        mm = []
        for _ in range(3):
            barrier()
            t0 = time.perf_counter()
            for _ in range(_MM_BATCH):
                torch.mm(a, b)
            mm.append((time.perf_counter() - t0) / _MM_BATCH)
        x, y = torch.randn(_ELEMENTWISE), torch.randn(_ELEMENTWISE)  # memory-bound: an add of 4 MiB blocks
        out = torch.add(x, y)
        ew = []
        for _ in range(3):
            barrier()
            t0 = time.perf_counter()
            for _ in range(_MM_BATCH):
                torch.add(x, y, out=out)
            ew.append((time.perf_counter() - t0) / _MM_BATCH)
        mine = torch.tensor([statistics.median(t) for t in times] + [statistics.median(mm), statistics.median(ew)],
                            dtype=torch.float64)
        return pmax(mine, tuple(mesh.axis_names))  # the slowest rank's, the same on every rank

    out = shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(torch.zeros(1))
    seconds = device_get(out).tolist()
    points = {a: tuple(Point(op, s, step.nbytes, t) for (ax, op, s, step, _), t in zip(moves, seconds) if ax == a)
              for a in axes}
    return Timings(points, matmul, seconds[-2], _ELEMENTWISE * _ITEMSIZE, seconds[-1])


def calibrate(mesh, *, sizes: Sequence[int] = SIZES,
              ops: Sequence[str] = OPS, repeats: int = 7, matmul: int = 512, progress: bool = False) -> CostModel:
    """A ``CostModel`` measured on ``mesh`` (module doc): per-axis latency and bandwidth fitted to
    ``reshard``'s moves of ``sizes``-byte blocks, and one rank's matmul throughput beside its peers."""
    timings = measure(mesh, sizes=sizes, ops=ops, repeats=repeats, matmul=matmul, progress=progress)
    model = from_timings(timings)
    if progress:
        print(f"calibrate: {model}", file=sys.stderr, flush=True)
    return model


def from_timings(timings: Timings) -> CostModel:
    """The fitted ``CostModel`` of ``timings``; ``"*"`` is the slowest measured axis."""
    latency, bandwidth = {}, {}
    for axis, points in timings.steps.items():
        alpha, beta = fit([p.nbytes for p in points], [p.seconds for p in points])
        if beta <= 0:
            raise ValueError(f"calibrate: collectives along {axis!r} took no longer for {max(p.block for p in points)} "
                             f"byte blocks than for {min(p.block for p in points)}; timings this noisy give no "
                             "bandwidth. Pass larger sizes= (a few MiB) or more repeats=.")
        latency[axis], bandwidth[axis] = alpha, 1 / beta
    if latency:
        ref = 4 * MiB  # the slowest axis for a mid-size step stands in for axes not measured
        slow = max(latency, key=lambda a: latency[a] + ref / bandwidth[a])
        latency["*"], bandwidth["*"] = latency[slow], bandwidth[slow]
    else:
        latency, bandwidth = CostModel.latency, CostModel.bandwidth
    return CostModel(measured=True, flops_per_s=timings.flops_per_s, bandwidth=bandwidth, latency=latency,
                     memory_bandwidth=timings.memory_bandwidth)

