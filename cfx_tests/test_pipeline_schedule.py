"""Schedule generators: each validates, has the textbook shape and memory, rejects bad sizes."""
from collections import Counter

import pytest

from cfx._src.pipeline.schedule import (Action, Schedule, gpipe, interleaved_1f1b, one_f_one_b,
                                        zb_h1)
from cfx._src.pipeline.validate import ScheduleError, validate

P = (1, 2, 4)
M = range(1, 17)


def interleaved_peak(p, m, v):
    """Chunk activations alive on rank 0 of interleaved 1F1B (each chunk counts once): the
    warm-up 2(p-1) + (v-1)p forwards plus the first steady forward, capped by all m*v forwards;
    v = 1 is plain 1F1B."""
    return min(m, p) if v == 1 else min(m * v, (v + 1) * p - 1)


def all_schedules():
    for p in P:
        for m in M:
            yield gpipe(p, m), m
            yield one_f_one_b(p, m), min(p, m)
            yield zb_h1(p, m), min(p, m)
            for v in (1, 2, 3):
                if m % p == 0:
                    yield interleaved_1f1b(p, m, v), interleaved_peak(p, m, v)


@pytest.mark.parametrize("sched,limit", list(all_schedules()),
                         ids=lambda x: f"{x.name}-p{x.n_ranks}-m{x.n_microbatches}-v{x.n_chunks}"
                         if isinstance(x, Schedule) else str(x))
def test_valid_with_tight_in_flight_limit(sched, limit):
    validate(sched, max_in_flight=limit)
    assert max(sched.peak_in_flight(r) for r in range(sched.n_ranks)) == limit
    assert sched.peak_in_flight(0) == limit  # rank 0 holds the most
    if limit > 1:
        with pytest.raises(ScheduleError, match=r"rank 0, step \d+ \(F\d+s\d+\).*max_in_flight"):
            validate(sched, max_in_flight=limit - 1)


@pytest.mark.parametrize("p", P)
@pytest.mark.parametrize("gen", [gpipe, one_f_one_b, zb_h1, interleaved_1f1b])
def test_action_counts(gen, p):
    for m in range(p, 17, p):
        for v in ((1, 2, 3) if gen is interleaved_1f1b else (1,)):
            sched = gen(p, m, v) if gen is interleaved_1f1b else gen(p, m)
            n = p * v
            assert (sched.n_ranks, sched.n_microbatches, sched.n_chunks, sched.n_stages) == \
                (p, m, v, n)
            for r in range(p):
                kinds = Counter(a.kind for a in sched.compute_actions(r))
                backward = {"I": m * v, "W": m * v} if gen is zb_h1 else {"B": m * v}
                assert kinds == Counter({"F": m * v, **backward})
                assert {a.stage for a in sched.compute_actions(r)} == set(sched.stages_of(r))
            total = Counter(a.kind for acts in sched.actions for a in acts)
            hops = m * (n - 1) if p > 1 else 0  # one message per stage boundary and microbatch
            for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                assert total[kind] == hops


def test_layout():
    s = interleaved_1f1b(4, 8, 3)
    assert s.stages_of(1) == [1, 5, 9]
    assert [s.stage_rank(x) for x in range(12)] == [0, 1, 2, 3] * 3
    assert gpipe(3, 2).stages_of(2) == [2]


def test_one_f_one_b_warmup_and_order():
    p, m = 4, 8
    s = one_f_one_b(p, m)
    for r in range(p):
        kinds = "".join(a.kind for a in s.compute_actions(r))
        warm = p - r - 1
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm
    assert [str(a) for a in s.actions[1][:4]] == ["RECV_F0s0<-0", "F0s1", "SEND_F0s1->2",
                                                  "RECV_F1s0<-0"]


def test_zb_h1_defers_w_by_rank():
    p, m = 4, 8
    s = zb_h1(p, m)
    for r in range(p):
        acts = s.compute_actions(r)
        i_pos = {a.microbatch: k for k, a in enumerate(acts) if a.kind == "I"}
        w_pos = {a.microbatch: k for k, a in enumerate(acts) if a.kind == "W"}
        for j in range(m - r):  # W(j) runs right after I(j + r)
            assert w_pos[j] == i_pos[j + r] + 1
        assert "".join(a.kind for a in acts).endswith("I" + "W" * (r + 1))  # W's fill the tail
        assert s.peak_in_flight(r, release="W") == p  # counting until W: still the 1F1B peak


def test_interleaved_v1_is_1f1b():
    for p in P:
        for m in range(p, 17, p):
            assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


def test_interleaved_order_goes_in_groups_of_p():
    s = interleaved_1f1b(2, 4, 2)
    fwd = [(a.microbatch, a.stage // 2) for a in s.compute_actions(0) if a.kind == "F"]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [(a.microbatch, a.stage // 2) for a in s.compute_actions(0) if a.kind == "B"]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_single_rank_has_no_messages():
    s = interleaved_1f1b(1, 3, 3)
    assert all(a.kind in "FBIW" for a in s.actions[0])
    validate(s)


@pytest.mark.parametrize("call,match", [
    (lambda: gpipe(0, 4), r"n_ranks p must be an integer >= 1, got 0"),
    (lambda: one_f_one_b(2, 0), r"n_microbatches m must be an integer >= 1, got 0"),
    (lambda: zb_h1(2, -1), r"n_microbatches m .* got -1"),
    (lambda: gpipe(2.0, 4), r"n_ranks p .* got 2.0"),
    (lambda: one_f_one_b(True, 4), r"n_ranks p .* got True"),
    (lambda: interleaved_1f1b(2, 4, 0), r"n_chunks v must be an integer >= 1, got 0"),
    (lambda: interleaved_1f1b(4, 6, 2), r"m=6 must be a multiple of n_ranks p=4.*use m=4 or m=8"),
    (lambda: interleaved_1f1b(4, 3, 2), r"m=3 must be a multiple .*use m=4\.$"),
    (lambda: Action("X", 0, 0), r"kind must be one of"),
    (lambda: Action("SEND_F", 0, 0), r"give peer="),
    (lambda: Action("F", 0, 0, peer=1), r"give peer="),
    (lambda: Action("F", -1, 0), r"microbatch must be an integer >= 0, got -1"),
    (lambda: Action("RECV_B", 0, 1, peer=1.0), r"peer must be an integer >= 0, got 1.0"),
    (lambda: Schedule("s", 2, 1, 1, ((),)), r"one action list per rank"),
    (lambda: Schedule("s", 1, 1, 0, ((),)), r"Schedule 's': n_chunks v must be an integer >= 1"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_action_str():
    assert str(Action("F", 3, 1)) == "F3s1"
    assert str(Action("SEND_F", 3, 1, peer=2)) == "SEND_F3s1->2"
    assert str(Action("RECV_B", 0, 2, peer=2)) == "RECV_B0s2<-2"
