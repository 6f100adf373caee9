"""Plans for a cluster, best first: every plan ``Plan.parse`` would accept over pipe x data x seq x
model for the cluster's GPU count, each estimated, the ones that do not fit refused.

Two passes. The first estimates every candidate on the model's shape alone (``TransformerShape``: the state
as fp32 params and gradients and Adam's moments, split as the plan splits them), fast enough for
thousands; the best ``exact`` of those that fit are estimated again with the plan's own accounting of
the model (``plan.build.account``, what ``Plan.describe`` prints and the step holds) and ranked on that.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Iterator

from cfx._src.estimate.cluster import Cluster
from cfx._src.estimate.estimate import Estimate, check_length, estimate
from cfx._src.estimate.workload import TransformerShape
from cfx._src.plan.plan import Plan


@dataclasses.dataclass(frozen=True)
class Search:
    """What ``search`` found: the best plans' estimates (``best``, fastest first, all fitting),
    how many candidates were estimated (``searched``), how many fit, and the seconds it took."""

    best: list[Estimate]
    searched: int
    fitting: int
    seconds: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: TransformerShape, gpus: int, rows: int, seq: int, *, gpus_per_node: int = 8,
               precision: str = "bf16") -> Iterator[Any]:
    """Every plan over pipe x data x expert x seq x model for ``gpus`` ranks that splits this model and batch:
    tensor parallelism within a node (dividing the heads, the MLP and the vocabulary), pipelines of at most one layer per stage,
    a split sequence (ring, Ulysses), ZeRO 0-3, remat none / dots / blocks, Megatron-SP with a model
    axis, microbatches p, 2p or 4p per pipeline and its schedules (1F1B, interleaved, ZB-H1); for a mixture
    of experts, every expert axis dividing the experts that the data-parallel ranks can make."""
    for t in _divisors(min(gpus, gpus_per_node)):
        if shape.heads % t or shape.kv_heads % t or shape.ffn % t or shape.vocab % t or gpus % t:
            continue
        for p in _divisors(gpus // t):
            if p > shape.layers:
                continue
            for cp in _divisors(gpus // (t * p)):
                d = gpus // (t * p * cp)
                if cp > 8 or rows % d or seq % (2 * cp):
                    continue
                for e in [k for k in _divisors(d) if shape.experts % k == 0] if shape.experts else [1]:
                    mesh = ",".join(f"{a}={n}" for a, n in (("pipe", p), ("data", d // e), ("expert", e), ("seq", cp),
                                                            ("model", t)) if n > 1)
                    yield from _plans(shape, mesh, p, d, cp, t, rows, precision)


def _plans(shape: TransformerShape, mesh: str, p: int, d: int, cp: int, t: int, rows: int,
           precision: str) -> Iterator[Any]:
    """The plans of one mesh: its ZeRO stages, remats, pipeline microbatches and schedules, sequence methods."""
    per_rank = rows // d
    pipes = [("", 1)]
    if p > 1:
        pipes = []
        for m in (p, 2 * p, 4 * p):
            if per_rank % m == 0:
                pipes += [(f" microbatches={m}", m), (f" microbatches={m} schedule=zb-h1", m)]
                if shape.layers % (2 * p) == 0:
                    pipes.append((f" microbatches={m} schedule=interleaved", m))
    seqs = [""] + ([" sp=ulysses"] if cp > 1 and shape.heads % (cp * t) == 0 else [])
    seqs += [" sp=megatron"] if t > 1 and cp == 1 else []
    for zero, remat, (pipe, _), sp in itertools.product((0, 1, 2, 3) if d > 1 else (0,),
                                                        ("none", "dots", "blocks"), pipes, seqs):
        text = f"{mesh or 'data=1'} zero={zero} remat={remat} precision={precision}{pipe}{sp}"
        try:
            yield Plan.parse(text)
        except ValueError:   # a combination the strategies refuse
            continue


def search(model: Any, cluster: Cluster, *, batch: tuple[int, int], top: int = 5, exact: int = 8,
           precision: str = "bf16", stack: str = "cfx") -> Search:
    """The ``top`` fastest plans that fit (module doc) for ``model`` (a cfx decoder, or a ``TransformerShape``
    shape: then no second pass) on ``cluster`` with a global ``batch`` of ``(rows, seq)``."""
    start = time.perf_counter()
    shape = model if isinstance(model, TransformerShape) else TransformerShape.of(model)
    rows, seq = batch
    check_length(model, seq)
    rough = []
    searched = 0
    for plan in candidates(shape, cluster.gpus, rows, seq, gpus_per_node=cluster.gpus_per_node, precision=precision):
        searched += 1
        e = estimate(shape, plan, cluster, batch=batch, stack=stack)
        if e.fits:
            rough.append((e.step_s, plan))
    if not searched:
        raise ValueError(f"cfx.parallel.search: no plan over {cluster.gpus} GPUs splits a batch of {rows} x {seq} "
                         f"for {shape.name or 'this model'}; use a batch of rows divisible by the data axes' sizes.")
    rough.sort(key=lambda x: x[0])
    best = []
    for _, plan in rough[:max(exact, top) if not isinstance(model, TransformerShape) else top]:
        e = estimate(model, plan, cluster, batch=batch, stack=stack)
        if e.fits:
            best.append(e)
    best.sort(key=lambda e: e.step_s)
    return Search(best[:top], searched, len(rough), time.perf_counter() - start)
