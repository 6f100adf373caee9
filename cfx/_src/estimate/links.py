"""What a plan's collectives cost on a cluster: ``Links`` (the link each mesh axis crosses, a ring
collective's seconds on it, a step's recorded calls timed) and ``collective_s`` (a ring collective's
seconds from its size, ranks, latency and bus bandwidth)."""
from __future__ import annotations

import math
from typing import Any

from cfx._src.estimate import constants as C
from cfx._src.estimate.cluster import Cluster, Link


class Links:
    """``plan``'s mesh axes on ``cluster``: ranks numbered with the plan's last mesh axis fastest, nodes
    holding consecutive ranks."""

    def __init__(self, plan: Any, cluster: Cluster):
        self.plan, self.cluster = plan, cluster

    def link(self, axis: str) -> tuple[Link, float]:
        """The link an axis's collectives cross and the bus bandwidth its group reaches: inside a node when
        the axis's ranks all share one, else InfiniBand, with as many HCAs in parallel as ranks per node."""
        sizes = [s for _, s in self.plan.mesh]
        names = [a for a, _ in self.plan.mesh]
        stride = math.prod(sizes[names.index(axis) + 1:])
        n, per_node = self.plan.size(axis), self.cluster.gpus_per_node
        if stride * n <= per_node:
            return self.cluster.intra, self.cluster.intra.busbw
        k = max(1, per_node // stride)
        return self.cluster.inter, min(self.cluster.intra.busbw, self.cluster.inter.busbw * k)

    def collective(self, axis: str, kind: str, nbytes: float) -> float:
        """Seconds of one ring collective over ``axis`` whose whole (gathered / summed) tensor is ``nbytes``."""
        link, bw = self.link(axis)
        return collective_s(kind, self.plan.size(axis), nbytes, link.latency, bw)

    def records_s(self, records: Any) -> dict[str, float]:
        """Seconds of a rehearsed step's collectives (``cfx.comm_stats``' records, every rank's) outside the
        pipeline's sends, per mesh axis (a record over several axes counts on ``data`` if among them, else on
        its first), the busiest rank's: each call timed as ``collective`` times one of its op and bytes."""
        per: dict[tuple[int, str], float] = {}
        for r in records:
            if "pipe" in r.axes:
                continue
            key = (r.rank, "data" if "data" in r.axes else r.axes[0])
            per[key] = per.get(key, 0.0) + self.call_s(r)
        out: dict[str, float] = {}
        for (_, axis), t in per.items():
            out[axis] = max(out.get(axis, 0.0), t)
        return out

    def phases_s(self, records: Any) -> tuple[float, float]:
        """Seconds of one rank's ``records`` (a grid's: ``grid_time``), forward's and backward's, each call
        timed on its axes' link."""
        out = [0.0, 0.0]
        for r in records:
            out[r.backward] += self.call_s(r)
        return out[0], out[1]

    def call_s(self, r: Any) -> float:
        """Seconds of one collective call (a ``cfx.comm_stats`` record) on the slowest link of its axes."""
        n = math.prod(self.plan.size(a) for a in r.axes)
        links = [self.link(a) for a in r.axes]
        latency, bw = max(link.latency for link, _ in links), min(b for _, b in links)
        kind = {"ppermute": "p2p", "ragged_all_to_all": "all_to_all"}.get(r.op, r.op)
        whole = r.nbytes * n if kind == "all_gather" else r.nbytes  # (a gather's payload: the rank's part)
        return collective_s(kind, n, whole, latency, bw)


def collective_s(kind: str, n: int, nbytes: float, latency: float, busbw: float, backend: str = "nccl") -> float:
    """Seconds of one collective over ``n`` ranks in a ring (NCCL's algorithm for large tensors) whose
    whole tensor -- summed, gathered, scattered -- is ``nbytes``, each of its ``n - 1`` steps ``latency`` s,
    ``busbw`` bytes/s per rank and direction: an all-reduce is a reduce-scatter and an all-gather, each
    moving ``(n - 1) / n`` of the tensor through every rank; ``p2p`` one message. ``backend``'s own
    algorithms (``constants.ALGORITHMS``: gloo's reduce-scatter is an all-reduce) replace the ring's."""
    if n == 1 or nbytes <= 0:
        return 0.0
    kind = C.ALGORITHMS[backend].get(kind, kind)
    if kind == "p2p":
        return latency + nbytes / busbw
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}[kind]
    return steps * ((n - 1) * latency + (n - 1) / n * nbytes / busbw)
