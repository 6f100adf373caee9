"""Exact coarsening of the strategy ILP (``ilp.Problem``) before it is solved, and the expansion of
the coarse choice back to every original node.

A 12-layer GPT-2 step is ~1,800 ops, ~19,000 strategies and ~290,000 edge variables; most of that
is structure the solver need not see. ``coarsen`` works on a copy of the graph in which a node
stands for a set of original nodes (its ``members``) and each of its strategies is a row of their
original strategies (``rows``, (S, k)); a node pair has one resharding matrix (parallel edges
summed). Until none applies it

* drops a *separable* edge, ``R[s, t] = a[s] + b[t]`` (all zero, or a price one side alone sets),
  adding ``a`` and ``b`` to the two nodes' costs;
* merges a *follower*: an edge on which each strategy ``s`` of ``u`` affords one strategy ``f(s)``
  of ``v`` (a ``getitem`` of its op, a node with a single strategy; every other entry
  ``>= INFEASIBLE``): ``v`` joins ``u``, row ``s`` extended by ``f(s)``, ``v``'s cost, memory and
  other edges read through ``f``;
* drops a *dominated* strategy: another of the node's costs no more, holds no more memory and
  reshards no more on every edge (of equal ones the first stays);
* *eliminates* a node with at most two neighbours (variable elimination, as a chain DP does): for
  each strategy (pair) of its neighbours its cheapest strategy (of equally cheap ones the least
  memory), the price folded into the neighbour's cost or into an edge between the two (a min-plus
  product). Memory would make this inexact, so under a finite budget a node goes only where, for
  every choice of its neighbours, one of its least-memory strategies is also a cheapest (its bytes
  then a constant of every plan).

Each step keeps the optimum (an infeasible entry is never part of one), so ``expand`` of the coarse
problem's optimal choice is an optimal choice of the original: the one ``search`` returns, priced on
the original problem.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from cfx._src.autoshard.ilp import INFEASIBLE, Problem

_MAX_TRIPLE = 1 << 21  # a chain elimination's (S_a, S_v, S_b) table at most this many entries


@dataclasses.dataclass(frozen=True)
class _Eliminated:
    members: np.ndarray                                   # (k,) original nodes
    rows: np.ndarray                                      # (S_v, k) their original strategies
    neighbours: tuple[tuple[np.ndarray, np.ndarray], ...]  # each neighbour's (members, rows) then
    best: np.ndarray                                      # (S_a[, S_b]) the row chosen per neighbour rows


@dataclasses.dataclass(frozen=True)
class Coarse:
    problem: Problem                      # the coarse problem to solve
    members: tuple[np.ndarray, ...]       # per coarse node: the original nodes it stands for
    rows: tuple[np.ndarray, ...]          # per coarse node: (S, k) their original strategies
    eliminated: tuple[_Eliminated, ...]   # in elimination order
    size: int                             # the original problem's node count

    def expand(self, choice: Sequence[int]) -> tuple[int, ...]:
        """The original problem's choice of the coarse ``choice`` (eliminations undone last first)."""
        assign = np.full(self.size, -1)
        for members, rows, c in zip(self.members, self.rows, choice):
            assign[members] = rows[c]
        for e in reversed(self.eliminated):
            at = tuple(_row(m, r, assign) for m, r in e.neighbours)
            assign[e.members] = e.rows[e.best[at]]
        assert (assign >= 0).all(), "autoshard: coarsening lost a node"
        return tuple(int(a) for a in assign)


def coarsen(p: Problem) -> Coarse:
    """``p`` reduced by the module doc's exact steps until none applies."""
    w = _Work(p)
    queue, queued = list(range(len(p.costs)))[::-1], set(range(len(p.costs)))
    while queue:
        v = queue.pop()
        queued.discard(v)
        if v not in w.cost:
            continue
        for u in w.simplify(v):
            if u not in queued:
                queued.add(u)
                queue.append(u)
    alive = sorted(w.cost)
    index = {v: i for i, v in enumerate(alive)}
    edges = [(index[u], index[v], r) for u in alive for v, r in w.adj[u].items() if u < v]
    coarse = Problem.make([w.cost[v] for v in alive], [w.mem[v] for v in alive], edges,
                          p.budget - w.offset_memory)
    return Coarse(coarse, tuple(w.members[v] for v in alive), tuple(w.rows[v] for v in alive),
                  tuple(w.eliminated), len(p.costs))


class _Work:
    """The graph being coarsened: per live node its cost, memory, members, rows and neighbours."""

    def __init__(self, p: Problem):
        n = len(p.costs)
        self.bounded = math.isfinite(p.budget)
        self.cost = {v: c.copy() for v, c in enumerate(p.costs)}
        self.mem = {v: m.copy() for v, m in enumerate(p.memory)}
        self.members = {v: np.array([v]) for v in range(n)}
        self.rows = {v: np.arange(c.size)[:, None] for v, c in enumerate(p.costs)}
        self.adj: dict[int, dict[int, np.ndarray]] = {v: {} for v in range(n)}  # adj[u][v]: (S_u, S_v)
        self.eliminated: list[_Eliminated] = []
        self.offset_memory = 0.0
        for u, v, r in p.edges:
            if u == v:
                self.cost[u] = self.cost[u] + np.diag(r)
            else:
                self.link(u, v, r)

    def link(self, u: int, v: int, r: np.ndarray) -> None:
        if v in self.adj[u]:
            r = self.adj[u][v] + r
        self.adj[u][v], self.adj[v][u] = r, r.T

    def unlink(self, u: int, v: int) -> np.ndarray:
        del self.adj[v][u]
        return self.adj[u].pop(v)

    def simplify(self, v: int) -> set[int]:
        """One reduction at ``v``; the nodes to look at again (none: nothing applied)."""
        for u, r in list(self.adj[v].items()):
            sep = _separable(r)
            if sep is not None:
                self.unlink(v, u)
                self.cost[v], self.cost[u] = self.cost[v] + sep[0], self.cost[u] + sep[1]
                return {v, u}
            ok = r < INFEASIBLE
            if (ok.sum(1) <= 1).all():  # each strategy of v affords one of u
                return self.merge(v, u, r.argmin(1))
            if (ok.sum(0) <= 1).all():
                return self.merge(u, v, r.argmin(0))
        keep = self.undominated(v)
        if keep is not None:
            self.restrict(v, keep)
            return {v, *self.adj[v]}
        if len(self.adj[v]) <= 2 and len(self.cost) > 1:
            return self.eliminate(v)
        return set()

    def merge(self, u: int, v: int, f: np.ndarray) -> set[int]:
        """``v`` joins ``u``: ``u``'s strategy ``s`` takes ``v``'s ``f[s]``."""
        r = self.unlink(u, v)
        self.cost[u] = self.cost[u] + self.cost.pop(v)[f] + r[np.arange(f.size), f]
        self.mem[u] = self.mem[u] + self.mem.pop(v)[f]
        self.members[u] = np.concatenate([self.members[u], self.members.pop(v)])
        self.rows[u] = np.hstack([self.rows[u], self.rows.pop(v)[f]])
        for x in list(self.adj[v]):
            self.link(u, x, self.unlink(v, x)[f])
        del self.adj[v]
        return {u, *self.adj[u]}

    def undominated(self, v: int) -> np.ndarray | None:
        """``v``'s strategies left once each kept one drops those it beats or ties (None: all)."""
        f = np.hstack([self.cost[v][:, None], self.mem[v][:, None], *self.adj[v].values()])  # (S, K)
        drop = np.zeros(len(f), bool)
        for a in range(len(f)):
            if not drop[a]:  # the first of a class of ties stays (it drops the rest)
                no_worse = (f[a] <= f).all(1)
                no_worse[a] = False
                drop |= no_worse
        return np.flatnonzero(~drop) if drop.any() else None

    def restrict(self, v: int, keep: np.ndarray) -> None:
        self.cost[v], self.mem[v], self.rows[v] = self.cost[v][keep], self.mem[v][keep], self.rows[v][keep]
        for u in list(self.adj[v]):
            r = self.unlink(v, u)[keep]
            self.adj[v][u], self.adj[u][v] = r, r.T

    def eliminate(self, v: int) -> set[int]:
        """Variable elimination of ``v`` (its neighbours, at most two, keep its best reply)."""
        nbrs = list(self.adj[v])
        sizes = [self.cost[u].size for u in nbrs]
        if math.prod(sizes) * self.cost[v].size > _MAX_TRIPLE:
            return set()
        # tot[t, s_a, s_b]: v's price in strategy t against its neighbours' strategies
        tot = self.cost[v].reshape(-1, *[1] * len(nbrs))
        for i, u in enumerate(nbrs):
            tot = tot + self.adj[v][u].reshape(-1, *[1] * i, sizes[i], *[1] * (len(nbrs) - 1 - i))
        order = np.argsort(self.mem[v], kind="stable")
        best = order[np.asarray(tot[order].argmin(0))]  # the cheapest, of those the least memory
        if self.bounded and (self.mem[v][best] > self.mem[v].min()).any():
            return set()
        price = np.take_along_axis(tot, best[None], 0)[0]  # (S_a[, S_b])
        self.eliminated.append(_Eliminated(self.members[v], self.rows[v],
                                           tuple((self.members[u], self.rows[u]) for u in nbrs), best))
        if self.bounded:
            self.offset_memory += float(self.mem[v].min())
        for u in nbrs:
            self.unlink(v, u)
        if len(nbrs) == 1:
            self.cost[nbrs[0]] = self.cost[nbrs[0]] + price
        elif len(nbrs) == 2:
            self.link(nbrs[0], nbrs[1], price)
        for d in (self.cost, self.mem, self.members, self.rows, self.adj):
            del d[v]
        return set(nbrs)


def _separable(r: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(a, b)`` with ``r[s, t] == a[s] + b[t]`` (to rounding), or None."""
    if not r.any():
        return np.zeros(r.shape[0]), np.zeros(r.shape[1])
    a, b = r[:, 0] - r[0, 0], r[0, :]
    if (r >= INFEASIBLE).any() or not np.allclose(r, a[:, None] + b[None, :], rtol=1e-12, atol=0.0):
        return None
    return a, b


def _row(members: np.ndarray, rows: np.ndarray, assign: np.ndarray) -> int:
    """The index of the row of ``rows`` the assignment gives ``members``."""
    hit = np.flatnonzero((rows == assign[members]).all(1))
    assert hit.size, "autoshard: an eliminated node's neighbour took a strategy it did not have"
    return int(hit[0])
