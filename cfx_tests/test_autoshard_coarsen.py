"""``autoshard.coarsen``: the coarse problem's optimum, expanded, is the original's. On random small
problems built from the shapes coarsening reduces (zero and separable edges, followers priced
``INFEASIBLE`` off their match, parallel edges, duplicate strategies, chains) with and without a
memory budget, against brute force; on traced steps (random MLPs, one- and two-layer GPT-2 on a
2 x 2 mesh), against the whole problem's ILP, the coarse one being far smaller."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cfx
from cfx._src.autoshard.coarsen import coarsen
from cfx._src.autoshard.graph import trace
from cfx._src.autoshard.ilp import INFEASIBLE, NoPlanFits, Problem, brute_force, solve
from cfx._src.autoshard.search import build, search

MESH = {"data": 2, "model": 2}


@st.composite
def problems(draw):
    n = draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = [int(rng.integers(1, 5)) for _ in range(n)]
    costs = [rng.integers(0, 20, s).astype(float) for s in sizes]
    memory = [rng.integers(1, 10, s).astype(float) for s in sizes]
    edges = []
    for v in range(n):
        for u in range(v):
            for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.5 else 0):  # parallel edges too
                kind = rng.integers(0, 4)
                shape = (sizes[u], sizes[v])
                if kind == 0:
                    r = rng.integers(0, 15, shape).astype(float)
                elif kind == 1:  # zero, or a price each end sets alone
                    r = np.add.outer(rng.integers(0, 5, shape[0]), rng.integers(0, 5, shape[1])) * rng.integers(0, 2)
                elif kind == 2:  # a follower: v's strategy a function of u's, at a price
                    f = rng.integers(0, shape[1], shape[0])
                    r = np.where(np.arange(shape[1]) == f[:, None], rng.integers(0, 9, shape[0])[:, None], INFEASIBLE)
                else:  # a chain-like move: free on the diagonal
                    r = np.where(np.equal.outer(np.arange(shape[0]), np.arange(shape[1])), 0, rng.integers(1, 9, shape))
                edges.append((u, v, r.astype(float)) if rng.random() < 0.7 else (v, u, r.T.astype(float)))
    for v in range(n):  # a strategy twice now and then: one copy goes, the other must stay
        if rng.random() < 0.3:
            costs[v], memory[v] = np.append(costs[v], costs[v][0]), np.append(memory[v], memory[v][0])
            edges = [(a, b, np.hstack([r, r[:, :1]]) if b == v else r) for a, b, r in edges]
            edges = [(a, b, np.vstack([r, r[:1]]) if a == v else r) for a, b, r in edges]
    least, most = sum(m.min() for m in memory), sum(m.max() for m in memory)
    budget = draw(st.sampled_from([math.inf, math.inf, most, (least + most) / 2, least, least - 1]))
    return Problem.make(costs, memory, edges, budget)


def _coarse_solve(p: Problem) -> tuple[int, ...]:
    c = coarsen(p)
    return c.expand(solve(c.problem).choice)


@pytest.mark.timeout(60)
@settings(deadline=None)
@given(problems())
def test_the_coarse_optimum_is_the_brute_force_optimum(p):
    try:
        want = brute_force(p)
    except NoPlanFits:
        with pytest.raises(NoPlanFits):
            _coarse_solve(p)
        return
    if want.objective >= INFEASIBLE:  # every plan pays an impossible move: none is a plan
        return
    choice = _coarse_solve(p)
    assert len(choice) == len(p.costs)
    assert p.objective(choice) == pytest.approx(want.objective, rel=1e-12, abs=1e-12)
    assert p.bytes(choice) <= p.budget


@pytest.mark.timeout(30)
def test_a_chain_collapses_and_a_follower_merges():
    # 0 - 1 - 2 a chain (eliminated into edges, then into 0's costs), 3 a getitem-like follower
    # of 0 (merged into it): the coarse problem is one node, its optimum the brute-force one
    r = np.array([[0.0, 4.0], [4.0, 0.0]])
    follow = np.array([[0.0, INFEASIBLE], [INFEASIBLE, 5.0]])  # 3 pays 5 to follow 0's strategy 1
    p = Problem.make([[1.0, 3.0], [2.0, 0.0], [0.0, 5.0], [7.0, 1.0]], edges=[(0, 1, r), (1, 2, r), (0, 3, follow)])
    c = coarsen(p)
    assert len(c.problem.costs) == 1 and not c.problem.edges
    choice = c.expand(solve(c.problem).choice)
    assert p.objective(choice) == brute_force(p).objective == 10.0  # 0, 0, 0, 0: 1 + 2 + 0 + 7


def mlp(seed: int):
    rng = np.random.default_rng(seed)
    widths = [int(w) for w in rng.choice([8, 16, 32, 64, 128], int(rng.integers(2, 5)))]
    batch = int(rng.choice([4, 16, 256, 4096]))
    act = [torch.relu, torch.tanh, torch.nn.functional.gelu][int(rng.integers(0, 3))]
    params = {f"w{i}": torch.zeros(a, b) for i, (a, b) in enumerate(zip(widths, widths[1:]))}
    params.update({f"b{i}": torch.zeros(b) for i, b in enumerate(widths[1:]) if rng.random() < 0.5})

    def step(p, x):
        for i in range(len(widths) - 1):
            x = x @ p[f"w{i}"] + p[f"b{i}"] if f"b{i}" in p else x @ p[f"w{i}"]
            x = act(x) if i < len(widths) - 2 else x
        return x.pow(2).mean()
    return trace(step, params, torch.zeros(batch, widths[0]))


def _agree(g, **kw) -> None:
    exact, fast = search(g, MESH, coarsen=False, gap=None, **kw), search(g, MESH, gap=None, **kw)
    # unbounded, the LP relaxation is integral (an exact optimum); under a budget HiGHS branches
    # and stops within its default 1e-4 relative gap (gap=None: no rounding shortcut)
    rel = 1e-4 if "budget" in kw else 1e-9
    assert fast.solution.objective == pytest.approx(exact.solution.objective, rel=rel, abs=0)
    assert fast.solution.memory <= kw.get("budget", math.inf)
    assert len(fast.choices) == len(g.ops) - 1
    problem, strats = build(g, MESH, **kw)
    assert all(s in ss for s, ss in zip(fast.choices, strats))
    assert problem.objective(fast.solution.choice) == fast.solution.objective


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(3))
def test_random_mlps_coarse_and_whole_agree(seed):
    g = mlp(seed)
    _agree(g)
    free = search(g, MESH)
    least = sum(float(m.min()) for m in build(g, MESH)[0].memory)
    _agree(g, budget=(least + free.solution.memory) / 2)  # a budget between the least and the free plan's


@functools.lru_cache(maxsize=None)
def gpt2(n_layer: int):
    model = cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=128, n_positions=32, n_embd=64, n_head=4)
    params = model.init(cfx.random.key(0))
    tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(0))
    return trace(lambda p, x, y: model.loss(p, x, y), params, tokens[:, :-1], tokens[:, 1:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_layer", [1, 2])
def test_gpt2_coarse_and_whole_agree(n_layer):
    g = gpt2(n_layer)
    _agree(g)
    problem, _ = build(g, MESH)
    small = coarsen(problem).problem
    assert len(small.costs) < 0.4 * len(problem.costs)  # 198 -> 60 nodes (1 layer), 345 -> 113 (2)
    assert sum(r.size for *_, r in small.edges) < 0.55 * sum(r.size for *_, r in problem.edges)  # ~0.49


@pytest.mark.timeout(60)
def test_gpt2_under_a_budget_coarse_and_whole_agree():
    g = gpt2(1)
    free = search(g, MESH)
    _agree(g, budget=free.solution.memory * 0.95)
