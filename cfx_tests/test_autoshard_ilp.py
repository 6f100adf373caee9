"""The strategy ILP (``cfx/_src/autoshard/ilp.py``) finds brute force's optimum: on random graphs of
up to 8 ops with up to 4 strategies each (a 2x2 mesh's replicate / split-one-axis / split-both
choices), random costs, resharding matrices and memory budgets, the objectives agree and the
budget holds; a budget nothing meets is refused naming the least it takes."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfx._src.autoshard.ilp import NoPlanFits, Problem, brute_force, solve


@st.composite
def problems(draw):
    n = draw(st.integers(1, 8))
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    costs = [rng.integers(0, 20, s).astype(float) for s in sizes]
    memory = [rng.integers(1, 10, s).astype(float) for s in sizes]
    edges = [(u, v, rng.integers(0, 15, (sizes[u], sizes[v])).astype(float))
             for v in range(n) for u in range(v) if rng.random() < 0.4]
    least, most = sum(m.min() for m in memory), sum(m.max() for m in memory)
    budget = draw(st.sampled_from([math.inf, most, (least + most) / 2, least, least - 1]))
    return Problem.make(costs, memory, edges, budget)


@settings(deadline=None)
@given(problems())
def test_the_ilp_finds_the_brute_force_optimum(p):
    try:
        want = brute_force(p)
    except NoPlanFits:
        with pytest.raises(NoPlanFits, match="no strategy assignment fits"):
            solve(p)
        return
    got = solve(p)
    assert got.objective == pytest.approx(want.objective, abs=1e-9)
    assert got.memory <= p.budget + 1e-9
    assert p.objective(got.choice) == got.objective


def test_an_edge_cost_can_outweigh_a_cheaper_node_strategy():
    # node 1's strategy 0 is cheaper, but reading node 0's only layout in it costs a reshard
    p = Problem.make([[0.0], [1.0, 2.0]], edges=[(0, 1, [[5.0, 0.0]])])
    assert solve(p).choice == (0, 1) and solve(p).objective == 2.0


def test_a_fractional_relaxation_is_branched_on():
    # three nodes in a cycle, each edge paying 1 when its ends agree: the LP relaxation is all
    # halves at 0, the integer optimum 1 (two of three must agree)
    agree = np.eye(2)
    p = Problem.make([[0.0, 0.0]] * 3, edges=[(0, 1, agree), (1, 2, agree), (0, 2, agree)])
    assert solve(p).objective == brute_force(p).objective == 1.0


def test_bad_problems_name_the_node():
    with pytest.raises(ValueError, match="edge 0 -> 1 has a \\(1, 1\\) resharding matrix; expected \\(1, 2\\)"):
        Problem.make([[0.0], [1.0, 2.0]], edges=[(0, 1, [[5.0]])])
    with pytest.raises(ValueError, match="node 0 has 0 strategy costs"):
        Problem.make([[]])
    with pytest.raises(NoPlanFits, match="the smallest needs 3 bytes"):
        solve(Problem.make([[0.0, 1.0], [0.0]], [[2.0, 1.0], [2.0]], budget=2.5))


@pytest.mark.timeout(120)
def test_a_rounded_plan_within_the_gap_of_the_relaxation_is_within_it_of_the_optimum(monkeypatch):
    # where the LP relaxation is fractional, solve(gap=) rounds it and improves op by op: the plan it
    # keeps is within the gap of brute force's optimum and within the budget (the shortcut must run)
    from cfx._src.autoshard import ilp
    from cfx.bench.autoshard import random_problem
    rounded = []
    real = ilp._improved
    monkeypatch.setattr(ilp, "_improved", lambda p, c, **kw: rounded.append(1) or real(p, c, **kw))
    rng = np.random.default_rng(7)
    for _ in range(80):
        p = random_problem(rng)
        try:
            want = brute_force(p)
        except NoPlanFits:
            with pytest.raises(NoPlanFits):
                solve(p, gap=0.01)
            continue
        got = solve(p, gap=0.01)
        assert got.memory <= p.budget
        assert want.objective <= got.objective <= want.objective * 1.01 + 1e-9
    assert rounded, "no problem took the rounding path"
