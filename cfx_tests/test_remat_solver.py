"""The Rotor checkpointing DP against an exhaustive search, Chen's sqrt(n), and no remat."""
import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfx._src.remat.chain import Chain
from cfx._src.remat.solver import (B, DISCARD, F_ALL, F_CK, F_N, Op, chen, minimum_budget,
                                   no_remat, simulate, solve)


@st.composite
def chains(draw, max_n=10):
    n = draw(st.integers(1, max_n))
    ints = lambda lo, hi: st.lists(st.integers(lo, hi), min_size=n, max_size=n)  # noqa: E731
    x = draw(st.lists(st.integers(1, 5), min_size=n + 1, max_size=n + 1))
    extra = draw(ints(0, 6))
    return Chain.from_stages(fw=draw(ints(1, 9)), bw=draw(ints(1, 9)), x=x,
                             xbar=[x[i + 1] + extra[i] for i in range(n)], bw_tmp=draw(ints(0, 3)))


def budgets(chain):
    lo, hi = minimum_budget(chain), no_remat(chain).peak
    return st.integers(lo, hi + 2)


def brute_force(chain, budget):
    """Dijkstra over every state of the operation model (which activations are held, plain or
    with grad, and how far the backward has gone), any op in any order, peak <= budget."""
    c, n = chain, chain.n
    start = (("ck",) + ("",) * n, n)
    dist, heap = {start: 0}, [(0, start)]
    while heap:
        time, state = heapq.heappop(heap)
        if dist[state] < time:
            continue
        held, nxt = state
        if nxt == 0 and not any(held[1:]):
            return time
        for op in [Op(k, i) for i in range(1, n + 1) for k in (F_CK, F_N, F_ALL, B)] + \
                  [Op(DISCARD, j) for j in range(1, n + 1)]:
            try:
                t, peak, new = _step(c, held, nxt, op)
            except ValueError:
                continue
            if peak > budget:
                continue
            if dist.get(new, math.inf) > time + t:
                dist[new] = time + t
                heapq.heappush(heap, (time + t, new))
    return math.inf


def _step(c, held, nxt, op):
    """One op of the memory model in solver.py, written out independently of it."""
    n, i = c.n, op.stage
    size = lambda h, j: 0 if not h[j] else (c.xbar[j] if h[j] == "abar" else c.x[j])  # noqa
    grad = c.x[nxt] if nxt < n else 0
    mem = sum(size(held, j) for j in range(n + 1)) + grad
    h = list(held)
    if op.kind in (F_CK, F_N, F_ALL):
        if not h[i - 1] or h[i]:
            raise ValueError
        if op.kind == F_N and h[i - 1] != "a":  # F_n may not free a checkpoint or abar
            raise ValueError
        h[i] = "abar" if op.kind == F_ALL else "a"
        peak = mem + size(h, i)
        if op.kind == F_N:
            h[i - 1] = ""
        elif h[i - 1] == "a":  # read by F_ck / F_all: now a checkpoint
            h[i - 1] = "ck"
        return c.fw[i], peak, (tuple(h), nxt)
    if op.kind == B:
        if i != nxt or h[i] != "abar" or not h[i - 1]:
            raise ValueError
        peak = mem + c.x[i - 1] + c.bw_tmp[i] + (c.x[n] if i == n else 0)
        h[i] = ""
        return c.bw[i], peak, (tuple(h), nxt - 1)
    if h[i] not in ("a", "ck") or nxt > i:  # checkpoints persist until B(i + 1) has read them
        raise ValueError
    h[i] = ""
    return 0, mem, (tuple(h), nxt)


@given(st.data())
@settings(deadline=None)
def test_dp_equals_brute_force(data):
    chain = data.draw(chains(max_n=6))
    budget = data.draw(budgets(chain))
    sched = solve(chain, budget)
    assert sched.time == brute_force(chain, budget)
    assert simulate(chain, sched) == (sched.time, sched.peak)
    assert sched.peak <= budget


@given(st.data())
@settings(deadline=None)
def test_dp_fits_budget_and_beats_chen(data):
    chain = data.draw(chains())
    budget = data.draw(budgets(chain))
    sched = solve(chain, budget)
    time, peak = simulate(chain, sched.ops)
    assert (time, peak) == (sched.time, sched.peak) and peak <= budget
    base = chen(chain)
    if base.peak <= budget:
        assert sched.time <= base.time
    assert solve(chain, base.peak).time <= base.time  # at Chen's own peak, too
    assert solve(chain, 10**6).time == sum(chain.fw) + sum(chain.bw) == no_remat(chain).time


@given(chains())
@settings(deadline=None)
def test_minimum_budget_is_tight(chain):
    m = minimum_budget(chain)
    assert solve(chain, m).peak <= m
    with pytest.raises(ValueError, match=f"minimum feasible budget {m}"):
        solve(chain, m - 1)


def _example():
    return Chain.from_stages(fw=[2, 3, 1, 4], bw=[4, 6, 2, 8], x=[4, 2, 3, 2, 1], xbar=[5, 4, 3, 6],
                             bw_tmp=[0, 1, 0, 2])


def test_chen_on_a_uniform_chain():
    # 9 unit stages, segments of 3: the forward pays 6 stages (a3 and a6 kept), and each segment
    # but the last is recomputed once more with grad: 6 + 9 = 15 forwards, 9 backwards.
    chain = Chain.from_stages(fw=[1] * 9, bw=[1] * 9, x=[1] * 10, xbar=[1] * 9)
    sched = chen(chain)
    assert [str(op) for op in sched.ops[:6]] == ["F_ck(1)", "F_n(2)", "F_n(3)", "F_ck(4)",
                                                 "F_n(5)", "F_n(6)"]
    assert sched.time == 15 + 9
    # peak inside B(9): a0 a3 a6 abar7 abar8 abar9 + d9 + d8
    assert sched.peak == 8
    assert solve(chain, sched.peak).time <= sched.time
    assert no_remat(chain).peak == 1 + 9 + 2


def test_print_reads_well():
    chain = _example()
    text = str(solve(chain, minimum_budget(chain)))
    assert text.splitlines()[0].startswith("Schedule (rotor, budget ")
    assert "F_ck(1)" in text and "B(1)" in text and "held after" in text
    assert text.splitlines()[-1].split()[-2:] == ["a0", "d0"]


def test_simulate_rejects_bad_schedules():
    chain = _example()
    ops = list(no_remat(chain).ops)
    with pytest.raises(ValueError, match=r"input a\[1\] is not in memory"):
        simulate(chain, [Op(F_ALL, 2)] + ops)
    with pytest.raises(ValueError, match="incomplete"):
        simulate(chain, ops[:-1])
    with pytest.raises(ValueError, match=r"next backward must be B\(4\)"):
        simulate(chain, ops[:4] + [Op(B, 3)])
    with pytest.raises(ValueError, match=r"abar\[4\] is not in memory"):
        simulate(chain, [Op(F_CK, 1), Op(F_CK, 2), Op(F_CK, 3), Op(F_CK, 4), Op(B, 4)])
    with pytest.raises(ValueError, match=r"still needed by B\(2\)"):
        simulate(chain, [Op(F_CK, 1), Op(DISCARD, 1)])
    with pytest.raises(ValueError, match=r"F_n frees its input, but a\[1\] is a checkpoint"):
        simulate(chain, [Op(F_CK, 1), Op(F_CK, 2), Op(F_ALL, 3), Op(F_ALL, 4), Op(B, 4), Op(B, 3),
                         Op(DISCARD, 2), Op(F_N, 2)])


def test_byte_sized_chain_is_discretised_conservatively():
    chain = _example()
    big = Chain(fw=chain.fw, bw=chain.bw, x=[v * 1000 + 7 for v in chain.x],
                xbar=[0] + [v * 1000 + 7 for v in chain.xbar[1:]], bw_tmp=chain.bw_tmp)
    m = minimum_budget(big, max_slots=20)
    for budget in (m, m + 3000, 10**9):
        sched = solve(big, budget, max_slots=20)
        assert simulate(big, sched) == (sched.time, sched.peak) and sched.peak <= budget
    with pytest.raises(ValueError, match=f"minimum feasible budget {m}"):
        solve(big, m - 1, max_slots=20)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fw=(0, 1), bw=(0, 1), x=(1,), xbar=(0, 1)), "at least one stage"),
    (dict(fw=(0, 1), bw=(0, 1, 2), x=(1, 1), xbar=(0, 1)), "bw has length 3"),
    (dict(fw=(0, -1), bw=(0, 1), x=(1, 1), xbar=(0, 1)), r"fw\[1\] = -1"),
    (dict(fw=(0, 1), bw=(0, 1), x=(1, 1.5), xbar=(0, 2)), "integer"),
    (dict(fw=(0, 1), bw=(0, 1), x=(1, 3), xbar=(0, 2)), r"xbar\[1\] = 2 < x\[1\] = 3"),
    (dict(fw=(1, 1), bw=(0, 1), x=(1, 1), xbar=(0, 1)), r"fw\[0\] must be 0"),
])
def test_chain_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Chain(**kwargs)
