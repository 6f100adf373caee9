"""Gemini placement: Belady planning is optimal vs brute force and stays within the budget."""
import itertools

import pytest
from hypothesis import given, strategies as st

from cfx.gemini import Step, WarmupRecord, auto, device, host, plan_auto


def simulate(steps, accesses, chunk_bytes, non_model, budget, resident):
    """Replays a plan; checks every access finds its chunks resident within budget. -> fetches."""
    size = (lambda c: chunk_bytes) if isinstance(chunk_bytes, int) else (lambda c: chunk_bytes[c])
    live, fetches = set(resident), 0
    for step, need, nm in zip(steps, accesses, non_model, strict=True):
        assert set(step.evict) <= live and not set(step.fetch) & (live - set(step.evict))
        live = (live - set(step.evict)) | set(step.fetch)
        fetches += len(step.fetch)
        assert set(need) <= live
        assert sum(size(c) for c in live) + nm <= budget
    return fetches


def brute_force_min_fetches(accesses, n_chunks, chunk_bytes, non_model, budget, resident):
    """Min chunk fetches over every sequence of resident sets (any set, not only lazy ones)."""
    subsets = [frozenset(s) for r in range(n_chunks + 1) for s in itertools.combinations(range(n_chunks), r)]
    cost = {frozenset(resident): 0}
    for need, nm in zip(accesses, non_model):
        nxt = {}
        for live, c in cost.items():
            for s in subsets:
                if set(need) <= s and len(s) * chunk_bytes + nm <= budget:
                    nxt[s] = min(nxt.get(s, 1 << 30), c + len(s - live))
        cost = nxt
    return min(cost.values())


@st.composite
def problems(draw, equal_sizes=True):
    n = draw(st.integers(1, 5))
    chunk = st.integers(5, 30)
    chunk_bytes = 10 if equal_sizes else draw(st.lists(chunk, min_size=n, max_size=n))
    size = (lambda c: chunk_bytes) if equal_sizes else (lambda c: chunk_bytes[c])
    accesses = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True),
                             min_size=1, max_size=8))
    non_model = [draw(st.integers(0, 25)) for _ in accesses]
    need = max(sum(size(c) for c in a) + nm for a, nm in zip(accesses, non_model))
    budget = draw(st.integers(need, need + sum(size(c) for c in range(n))))
    resident = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    return n, accesses, chunk_bytes, non_model, budget, resident


@given(problems(), st.integers(0, 3))
def test_belady_moves_the_fewest_chunks_and_respects_the_budget(problem, prefetch):
    n, accesses, cb, nm, budget, resident = problem
    steps = plan_auto(accesses, cb, nm, budget, prefetch=prefetch, resident=resident)
    fetches = simulate(steps, accesses, cb, nm, budget, resident)
    assert fetches == brute_force_min_fetches(accesses, n, cb, nm, budget, resident)


@given(problems())
def test_prefetch_moves_fetches_earlier_without_adding_any(problem):
    n, accesses, cb, nm, budget, resident = problem
    lazy = plan_auto(accesses, cb, nm, budget, resident=resident)
    eager = plan_auto(accesses, cb, nm, budget, prefetch=2, resident=resident)
    assert [s.evict for s in eager] == [s.evict for s in lazy]
    simulate(eager, accesses, cb, nm, budget, resident)
    for c in range(n):  # the k-th fetch of each chunk happens no later than before
        when = lambda steps: [t for t, s in enumerate(steps) if c in s.fetch]
        assert len(when(eager)) == len(when(lazy))
        assert all(e <= l for e, l in zip(when(eager), when(lazy)))


@given(problems(equal_sizes=False), st.integers(0, 2))
def test_unequal_chunk_sizes_stay_within_budget(problem, prefetch):
    n, accesses, cb, nm, budget, resident = problem
    steps = plan_auto(accesses, cb, nm, budget, prefetch=prefetch, resident=resident)
    simulate(steps, accesses, cb, nm, budget, resident)


@given(problems(), st.integers(0, 2))
def test_deciding_step_by_step_is_as_good_as_the_plan(problem, prefetch):
    n, accesses, cb, nm, budget, resident = problem
    record = WarmupRecord(tuple(map(tuple, accesses)), tuple(nm), (cb,) * n)
    policy, live, steps = auto(budget, prefetch=prefetch), set(resident), []
    for t in range(len(accesses)):
        step = policy.decide(record, t, live)
        live = (live - set(step.evict)) | set(step.fetch)
        steps.append(step)
    assert simulate(steps, accesses, cb, nm, budget, resident) == \
        brute_force_min_fetches(accesses, n, cb, nm, budget, resident)
    assert policy.plan(record, resident) == plan_auto(accesses, cb, nm, budget, prefetch=prefetch,
                                                      resident=resident)


def test_belady_evicts_the_chunk_needed_furthest_ahead():
    # room for two chunks; at access 2 chunk 2 arrives and 0 (next used at 4) beats 1 (used at 3)
    steps = plan_auto([[0], [1], [2], [1], [0]], 10, [0] * 5, 20)
    assert [(s.evict, s.fetch) for s in steps] == [((), (0,)), ((), (1,)), ((0,), (2,)), ((), ()),
                                                   ((1,), (0,))]  # tie (never used again): lower index
    # activations growing at access 1 leave room for one chunk only
    steps = plan_auto([[0], [1], [0]], 10, [0, 15, 0], 30, prefetch=1)
    assert [(s.evict, s.fetch) for s in steps] == [((), (0, 1)), ((0,), ()), ((), (0,))]


def test_too_small_budget_states_the_bytes_needed():
    with pytest.raises(ValueError, match=r"needs at least 250 bytes.*access 1 uses chunks \[0, 1\] "
                                         r"\(200 bytes\) with 50 non-model bytes.*budget is 200"):
        plan_auto([[0], [0, 1]], 100, [10, 50], 200)
    with pytest.raises(ValueError, match="budget must be > 0"):
        auto(0)
    with pytest.raises(ValueError, match="give one per access"):
        WarmupRecord(((0,),), (), (10,))


def test_device_and_host_policies():
    record = WarmupRecord(((0,), (1, 2), (0,)), (0, 0, 0), (10, 10, 10))
    assert device().decide(record, 0, ()).fetch == (0, 1, 2)
    assert device().decide(record, 1, {0, 1, 2}) == Step((), ())
    step = host().decide(record, 1, {0, 2})
    assert (step.evict, step.fetch) == ((0,), (1,))
