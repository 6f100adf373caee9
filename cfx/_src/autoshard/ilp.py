"""Choosing one sharding strategy per op: the integer program of Alpa's intra-operator pass.

A ``Problem`` is a graph of ops: each node ``v`` has strategies ``s`` with a cost ``c[v][s]``
(its compute and the collectives the strategy itself needs, e.g. the all-reduce of a matmul split
along its contraction) and the bytes ``m[v][s]`` a rank holds for it; each edge ``u -> v`` has a
resharding cost ``R[e][s, t]``: moving ``u``'s output from strategy ``s``'s layout to the one
``v``'s strategy ``t`` reads. ``solve`` picks one strategy per node minimising

    sum_v c[v][s_v] + sum_(u,v) R[e][s_u, s_v]      subject to  sum_v m[v][s_v] <= budget

as a mixed-integer linear program (``scipy.optimize.milp``, HiGHS): binaries ``x[v, s]`` (one per
node), and per edge a continuous ``y[e, s, t]`` whose row sums are ``x[u, s]`` and column sums
``x[v, t]`` -- with 0/1 margins that pins ``y`` to the one chosen pair, so the edge term is exact
without a product of binaries. ``brute_force`` enumerates every assignment (small graphs: the
reference the tests hold the solver to).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    costs: tuple[np.ndarray, ...]                      # per node: (S_v,) cost of each strategy
    memory: tuple[np.ndarray, ...]                     # per node: (S_v,) bytes a rank holds
    edges: tuple[tuple[int, int, np.ndarray], ...]     # (u, v, R (S_u, S_v)) resharding costs
    budget: float = math.inf                           # bytes per rank

    @classmethod
    def make(cls, costs: Sequence, memory: Sequence | None = None, edges: Sequence = (),
             budget: float = math.inf) -> "Problem":
        costs = tuple(np.asarray(c, dtype=np.float64).reshape(-1) for c in costs)
        memory = tuple(np.zeros(len(c)) for c in costs) if memory is None else tuple(
            np.asarray(m, dtype=np.float64).reshape(-1) for m in memory)
        edges = tuple((int(u), int(v), np.asarray(r, dtype=np.float64)) for u, v, r in edges)
        p = cls(costs, memory, edges, float(budget))
        p.check()
        return p

    def check(self) -> None:
        if len(self.memory) != len(self.costs):
            raise ValueError(f"autoshard: {len(self.costs)} nodes have costs but {len(self.memory)} have memory.")
        for v, (c, m) in enumerate(zip(self.costs, self.memory)):
            if c.size == 0 or c.shape != m.shape:
                raise ValueError(f"autoshard: node {v} has {c.size} strategy costs and {m.size} memory figures; "
                                 "give each node at least one strategy, one cost and one size per strategy.")
        for u, v, r in self.edges:
            if not (0 <= u < len(self.costs) and 0 <= v < len(self.costs)):
                raise ValueError(f"autoshard: edge {u} -> {v} names a node outside 0..{len(self.costs) - 1}.")
            if r.shape != (self.costs[u].size, self.costs[v].size):
                raise ValueError(f"autoshard: edge {u} -> {v} has a {r.shape} resharding matrix; expected "
                                 f"{(self.costs[u].size, self.costs[v].size)} (strategies of {u} x of {v}).")

    def objective(self, choice: Sequence[int]) -> float:
        return float(sum(c[s] for c, s in zip(self.costs, choice))
                     + sum(r[choice[u], choice[v]] for u, v, r in self.edges))

    def bytes(self, choice: Sequence[int]) -> float:
        return float(sum(m[s] for m, s in zip(self.memory, choice)))


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]   # the strategy index of each node
    objective: float
    memory: float


class NoPlanFits(ValueError):
    """No assignment of strategies keeps a rank's bytes within the budget."""


def _infeasible(p: Problem) -> NoPlanFits:
    least = sum(float(m.min()) for m in p.memory)
    return NoPlanFits(f"autoshard: no strategy assignment fits {p.budget:.0f} bytes per rank; the smallest needs "
                      f"{least:.0f} bytes (every op at its least memory). Raise the budget, add ranks, or let the "
                      "plan offload / recompute.")


def solve(p: Problem, *, time_limit: float | None = None) -> Solution:
    """The cheapest assignment within the budget (module doc); ``NoPlanFits`` if none fits."""
    from scipy import optimize, sparse
    offsets = np.cumsum([0] + [c.size for c in p.costs])
    n_x = int(offsets[-1])
    edge_offsets = np.cumsum([n_x] + [r.size for _, _, r in p.edges])
    n = int(edge_offsets[-1])
    c = np.concatenate([*p.costs, *(r.reshape(-1) for _, _, r in p.edges)]) if n else np.zeros(0)
    rows, cols, vals, lb, ub = [], [], [], [], []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(lb)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lb.append(lo)
        ub.append(hi)

    for v, cv in enumerate(p.costs):  # one strategy per node
        row([(offsets[v] + s, 1.0) for s in range(cv.size)], 1.0, 1.0)
    for e, (u, v, r) in enumerate(p.edges):  # y's margins are the two nodes' choices
        su, sv, base = r.shape[0], r.shape[1], edge_offsets[e]
        for s in range(su):
            row([(base + s * sv + t, 1.0) for t in range(sv)] + [(offsets[u] + s, -1.0)], 0.0, 0.0)
        for t in range(sv):
            row([(base + s * sv + t, 1.0) for s in range(su)] + [(offsets[v] + t, -1.0)], 0.0, 0.0)
    if math.isfinite(p.budget):
        row([(offsets[v] + s, float(m[s])) for v, m in enumerate(p.memory) for s in range(m.size)], -np.inf, p.budget)
    A = sparse.csr_array((vals, (rows, cols)), shape=(len(lb), n))
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    res = optimize.milp(c, constraints=optimize.LinearConstraint(A, lb, ub), integrality=integrality,
                        bounds=optimize.Bounds(0, 1), options={"time_limit": time_limit} if time_limit else None)
    if res.status == 2:  # infeasible
        raise _infeasible(p)
    if res.x is None:
        raise RuntimeError(f"autoshard: the solver stopped without a plan ({res.message}).")
    x = res.x[:n_x]
    choice = tuple(int(np.argmax(x[offsets[v]:offsets[v + 1]])) for v in range(len(p.costs)))
    return Solution(choice, p.objective(choice), p.bytes(choice))


def brute_force(p: Problem) -> Solution:
    """Every assignment tried (small graphs only): the reference ``solve`` must equal."""
    best = None
    for choice in itertools.product(*(range(c.size) for c in p.costs)):
        if p.bytes(choice) > p.budget:
            continue
        obj = p.objective(choice)
        if best is None or obj < best.objective:
            best = Solution(tuple(choice), obj, p.bytes(choice))
    if best is None:
        raise _infeasible(p)
    return best
