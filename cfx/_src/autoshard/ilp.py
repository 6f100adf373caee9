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
without a product of binaries. Strategies whose rows (columns) of ``R`` are equal share one row
(column) of ``y``, a sum of their ``x`` as its margin: the same LP, fewer variables. The LP
relaxation is solved first; it is usually integral on these graphs, and then it is the optimum
(branch and bound runs only when it is not). ``brute_force`` enumerates every assignment (small
graphs: the reference the tests hold the solver to).
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


INFEASIBLE = 1e9  # the price of a move no collective makes (the ILP needs finite coefficients)


class NoPlanFits(ValueError):
    """No assignment of strategies keeps a rank's bytes within the budget."""


def infeasible(p: Problem) -> NoPlanFits:
    least = sum(float(m.min()) for m in p.memory)
    err = NoPlanFits(f"autoshard: no strategy assignment fits {p.budget:.0f} bytes per rank; the smallest needs "
                     f"{least:.0f} bytes (every op at its least memory). Raise the budget or add ranks.")
    err.problem = p
    return err


def solve(p: Problem, *, time_limit: float | None = None, gap: float | None = None) -> Solution:
    """The cheapest assignment within the budget (module doc); ``NoPlanFits`` if none fits.
    ``gap``: where the LP relaxation is fractional, branch and bound stops at a plan proven within
    this fraction of the optimum (None: HiGHS's default, 1e-4)."""
    from scipy import optimize, sparse
    if not p.costs:
        if p.budget < 0:
            raise infeasible(p)
        return Solution((), 0.0, 0.0)
    sizes = np.array([c.size for c in p.costs])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n_x, n_v = int(offsets[-1]), len(sizes)
    # constraint rows: one per node (its x sum to 1), then per edge u -> v the margins of y over
    # its classes of equal rows / columns of R: y[a, :] sums to x[u, s] over u's strategies s of
    # class a, y[:, b] to x[v, t] over class b (exact: the LP relaxation is the same as with one y
    # per pair, and a tensor's R depends only on its layout, which many strategies share)
    rows, cols, vals = [np.repeat(np.arange(n_v), sizes)], [np.arange(n_x)], [np.ones(n_x)]
    row, col, prices = n_v, n_x, []
    for u, v, r in p.edges:
        r, a, b = _classes(r)  # r: (A, B) distinct rows and columns; a: (S_u,) and b: (S_v,) classes
        (na, nb), su, sv = r.shape, len(a), len(b)
        y = col + np.arange(na * nb)
        ya, yb = np.divmod(np.arange(na * nb), nb)
        rows += [row + ya, row + na + yb, row + a, row + na + b]
        cols += [y, y, offsets[u] + np.arange(su), offsets[v] + np.arange(sv)]
        vals += [np.ones(2 * na * nb), -np.ones(su + sv)]
        row, col = row + na + nb, col + na * nb
        prices.append(r.reshape(-1))
    lb = np.concatenate([np.ones(n_v), np.zeros(row - n_v)])
    ub = lb.copy()
    if math.isfinite(p.budget):
        rows.append(np.full(n_x, row))
        cols.append(np.arange(n_x))
        vals.append(np.concatenate(p.memory))
        lb, ub, row = np.append(lb, -np.inf), np.append(ub, p.budget), row + 1
    A = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, col))
    c, constraints, bounds = _scaled([*p.costs, *prices]), optimize.LinearConstraint(A, lb, ub), optimize.Bounds(0, 1)
    options = {k: v for k, v in (("time_limit", time_limit), ("mip_rel_gap", gap)) if v is not None} or None
    res = optimize.milp(c, constraints=constraints, bounds=bounds, options=options)  # the relaxation
    if res.x is not None and not _integral(res.x[:n_x]) and gap:
        # the relaxation's optimum bounds every plan's from below: a rounded plan improved op by op
        # that comes within ``gap`` of it is as good as branch and bound would prove (which spends
        # most of its time proving it: cut rounds at the root)
        x = res.x[:n_x]
        choice = _improved(p, [int(np.argmax(x[offsets[v]:offsets[v + 1]])) for v in range(n_v)])
        bound = res.fun * _unit([*p.costs, *prices])
        if p.bytes(choice) <= p.budget and p.objective(choice) <= bound + gap * abs(bound):
            return Solution(tuple(choice), p.objective(choice), p.bytes(choice))
    if res.x is not None and not _integral(res.x[:n_x]):
        integrality = np.zeros(col)
        integrality[:n_x] = 1
        res = optimize.milp(c, constraints=constraints, integrality=integrality, bounds=bounds, options=options)
    if res.status == 2:  # infeasible
        raise infeasible(p)
    if res.x is None:
        raise RuntimeError(f"autoshard: the solver stopped without a plan ({res.message}).")
    x = res.x[:n_x]
    choice = tuple(int(np.argmax(x[offsets[v]:offsets[v + 1]])) for v in range(n_v))
    return Solution(choice, p.objective(choice), p.bytes(choice))


def _integral(x: np.ndarray) -> bool:
    return bool((np.minimum(x, 1 - x) < 1e-6).all())


def _classes(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``r``'s distinct rows and columns, and each row's and column's class among them."""
    r, a = np.unique(r, axis=0, return_inverse=True)
    r, b = np.unique(r, axis=1, return_inverse=True)
    return r, a.reshape(-1), b.reshape(-1)


def _improved(p: Problem, choice: list[int], sweeps: int = 50) -> list[int]:
    """``choice`` improved one node at a time (each node's best strategy given its neighbours'),
    keeping within the budget, until no node changes (iterated conditional modes)."""
    out_edges: list[list] = [[] for _ in p.costs]
    in_edges: list[list] = [[] for _ in p.costs]
    for u, v, r in p.edges:
        out_edges[u].append((v, r))
        in_edges[v].append((u, r))
    used = p.bytes(choice)
    if used > p.budget:  # a start over the budget: left to branch and bound
        return choice
    for _ in range(sweeps):
        changed = False
        for v, cv in enumerate(p.costs):
            total = cv.copy()
            for w, r in out_edges[v]:
                total += r[:, choice[w]]
            for u, r in in_edges[v]:
                total += r[choice[u], :]
            room = p.budget - used + p.memory[v][choice[v]]
            total[p.memory[v] > room] = np.inf
            best = int(np.argmin(total))
            if total[best] < total[choice[v]] - 1e-12 * max(1.0, abs(total[best])):
                used += p.memory[v][best] - p.memory[v][choice[v]]
                choice[v], changed = best, True
        if not changed:
            break
    return choice


def _unit(terms: list[np.ndarray]) -> float:
    """A typical coefficient, a power of two (``_scaled``'s unit)."""
    c = np.concatenate(terms)
    positive = c[(c < INFEASIBLE) & (c > 0)]
    return 2.0 ** np.round(np.log2(np.median(positive))) if positive.size else 1.0


def _scaled(terms: list[np.ndarray]) -> np.ndarray:
    """The objective's coefficients (x's, then each edge's y's) as HiGHS should see them: in units
    of a typical one (a power of two, so exactly; its tolerances are absolute, ~1e-7, and a plan's
    seconds are ~1e-4), an infeasible entry capped just above the dearest feasible plan."""
    c = np.concatenate(terms)
    ok = c < INFEASIBLE
    unit = _unit(terms)
    dearest = sum(float(t[t < INFEASIBLE].max(initial=0.0)) for t in terms)
    return np.where(ok, c, dearest + unit) / unit


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
        raise infeasible(p)
    return best
