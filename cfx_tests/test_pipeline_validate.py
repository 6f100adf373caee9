"""The validator against corrupted schedules: it must agree with a brute-force oracle on swaps,
reject every drop, duplicate and cross-rank move, and name the rank, step and action."""
import re
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cfx._src.pipeline.schedule import (Action, Schedule, gpipe, interleaved_1f1b, one_f_one_b,
                                        zb_h1)
from cfx._src.pipeline.validate import ScheduleError, validate


@st.composite
def schedules(draw, min_ranks=1):
    gen = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb_h1"]))
    p = draw(st.integers(min_ranks, 4))
    if gen == "interleaved":
        return interleaved_1f1b(p, p * draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    m = draw(st.integers(1, 6))
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}[gen](p, m)


def replace(sched, rank, acts):
    lists = list(sched.actions)
    lists[rank] = tuple(acts)
    return Schedule(sched.name, sched.n_ranks, sched.n_microbatches, sched.n_chunks, lists)


def oracle_ok(sched, max_in_flight):
    """Independent check for schedules holding the same actions as a valid one, reordered within
    ranks: every action's local needs come earlier on its rank, the activation count (+1 F,
    -1 B/I) stays within the limit, and program order plus SEND -> RECV edges form no cycle."""
    p, last = sched.n_ranks, sched.n_stages - 1
    for r, acts in enumerate(sched.actions):
        before, alive = set(), 0
        for a in acts:
            k, s, mb = a.kind, a.stage, a.microbatch
            local = lambda t: t % p == r  # noqa: E731  stage t on this rank
            needs = []  # each entry: any one of these (kind, stage, mb) must come earlier
            if k == "F" and s > 0:
                needs.append([("F" if local(s - 1) else "RECV_F", s - 1, mb)])
            if k in ("B", "I"):
                needs.append([("F", s, mb)])
                if s < last:
                    needs.append([("B", s + 1, mb), ("I", s + 1, mb)] if local(s + 1)
                                 else [("RECV_B", s + 1, mb)])
            if k == "W":
                needs.append([("I", s, mb)])
            if k == "SEND_F":
                needs.append([("F", s, mb)])
            if k == "SEND_B":
                needs.append([("B", s, mb), ("I", s, mb)])
            if not all(any(n in before for n in need) for need in needs):
                return False
            before.add((k, s, mb))
            alive += {"F": 1, "B": -1, "I": -1}.get(k, 0)
            if alive > max_in_flight:
                return False
    # Kahn's algorithm over (rank, step) nodes.
    nodes = [(r, i) for r, acts in enumerate(sched.actions) for i in range(len(acts))]
    succ = {n: [] for n in nodes}
    indeg = {n: 0 for n in nodes}
    where = {(a.kind, a.stage, a.microbatch): (r, i)
             for r, acts in enumerate(sched.actions) for i, a in enumerate(acts)}
    for r, i in nodes:
        a = sched.actions[r][i]
        edges = [(r, i + 1)] if i + 1 < len(sched.actions[r]) else []
        if a.kind.startswith("SEND"):
            edges.append(where["RECV" + a.kind[4:], a.stage, a.microbatch])
        for e in edges:
            succ[r, i].append(e)
            indeg[e] += 1
    queue, seen = deque(n for n in nodes if indeg[n] == 0), 0
    while queue:
        n = queue.popleft()
        seen += 1
        for e in succ[n]:
            indeg[e] -= 1
            if indeg[e] == 0:
                queue.append(e)
    return seen == len(nodes)


def named_steps(err, sched):
    """(rank, step) pairs the message names; each must show the action really at that step."""
    found = re.findall(r"rank (\d+), step (\d+) \(([^)]*)\)", str(err))
    assert found, str(err)
    for r, i, what in found:
        acts = sched.actions[int(r)]
        assert what == (str(acts[int(i)]) if int(i) < len(acts) else "end of list"), str(err)
    return [(int(r), int(i)) for r, i, _ in found]


def peak(sched):
    return max(sched.peak_in_flight(r) for r in range(sched.n_ranks))


@given(schedules(), st.data())
def test_swap_agrees_with_oracle(sched, data):
    r = data.draw(st.integers(0, sched.n_ranks - 1))
    acts = list(sched.actions[r])
    i = data.draw(st.integers(0, len(acts) - 2))
    j = data.draw(st.one_of(st.just(i + 1), st.integers(i + 1, len(acts) - 1)))
    acts[i], acts[j] = acts[j], acts[i]
    bad, limit = replace(sched, r, acts), peak(sched)
    if oracle_ok(bad, limit):
        validate(bad, max_in_flight=limit)
    else:
        with pytest.raises(ScheduleError) as err:
            validate(bad, max_in_flight=limit)
        named_steps(err.value, bad)


def test_oracle_sees_both_outcomes():
    s = gpipe(2, 2)  # rank 1: RECV_F0 F0 RECV_F1 F1 B1 SEND_B1 B0 SEND_B0
    a = list(s.actions[1])
    a[1], a[2] = a[2], a[1]  # receive both, then compute: still valid
    assert oracle_ok(replace(s, 1, a), 2)
    validate(replace(s, 1, a), max_in_flight=2)
    a = list(s.actions[0])  # rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B1 B1 RECV_B0 B0
    a[0], a[1] = a[1], a[0]  # SEND_F0 before F0
    assert not oracle_ok(replace(s, 0, a), 2)
    with pytest.raises(ScheduleError, match=r"rank 0, step 0 \(SEND_F0s0->1\): sends the output"):
        validate(replace(s, 0, a))
    a = list(s.actions[0])
    a[3], a[4] = a[4], a[3]  # wait for B1's gradient before sending F1's output: deadlock
    assert not oracle_ok(replace(s, 0, a), 2)
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*rank 0, step 3 \(RECV_B1s1<-1\)"
                                            r"(.|\n)*rank 1, step 2 \(RECV_F1s0<-0\)"):
        validate(replace(s, 0, a))


@given(schedules(), st.data())
def test_drop_is_rejected(sched, data):
    r = data.draw(st.integers(0, sched.n_ranks - 1))
    acts = list(sched.actions[r])
    del acts[data.draw(st.integers(0, len(acts) - 1))]
    bad = replace(sched, r, acts)
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    named_steps(err.value, bad)


@given(schedules(), st.data())
def test_duplicate_is_rejected(sched, data):
    r = data.draw(st.integers(0, sched.n_ranks - 1))
    acts = list(sched.actions[r])
    i = data.draw(st.integers(0, len(acts) - 1))
    k = data.draw(st.integers(0, len(acts)))
    acts.insert(k, acts[i])
    bad = replace(sched, r, acts)
    with pytest.raises(ScheduleError, match="duplicate") as err:
        validate(bad)
    assert named_steps(err.value, bad) == [(r, i + 1 if k <= i else k)]


@given(schedules(min_ranks=2), st.data())
def test_move_to_another_rank_is_rejected(sched, data):
    src = data.draw(st.integers(0, sched.n_ranks - 1))
    dst = data.draw(st.integers(0, sched.n_ranks - 2))
    dst += dst >= src
    acts = list(sched.actions[src])
    a = acts.pop(data.draw(st.integers(0, len(acts) - 1)))
    k = data.draw(st.integers(0, len(sched.actions[dst])))
    bad = replace(replace(sched, src, acts), dst, sched.actions[dst][:k] + (a,) +
                  sched.actions[dst][k:])
    with pytest.raises(ScheduleError, match=r"belongs on rank \d+|peer must be|handoff is local") \
            as err:
        validate(bad)
    assert named_steps(err.value, bad) == [(dst, k)]


def test_messages():
    s = one_f_one_b(2, 2)  # rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*rank 0, step 0 \(RECV_B0s1<-1\): "
                                            r"waits for SEND_B0s1 from rank 1, which that rank "
                                            r"issues only at its step 3(.|\n)*"
                                            r"rank 1, step 0 \(RECV_F0s0<-0\)"):
        validate(replace(s, 0, s.actions[0][4:5] + s.actions[0][:4] + s.actions[0][5:]))
    with pytest.raises(ScheduleError, match=r"rank 1, step 0 \(RECV_F0s0<-1\): peer must be "
                                            r"rank 0"):
        validate(replace(s, 1, (Action("RECV_F", 0, 0, peer=1),) + s.actions[1][1:]))
    z = zb_h1(1, 2)  # F0 I0 W0 F1 I1 W1
    with pytest.raises(ScheduleError, match=r"rank 0, step 1 \(W0s0\): needs I0s0 earlier"):
        validate(replace(z, 0, [z.actions[0][k] for k in (0, 2, 1, 3, 4, 5)]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 5 \(end of list\): W1s0 never runs"):
        validate(replace(z, 0, z.actions[0][:5]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 3 \(B0s0\): I of the same"):
        validate(replace(z, 0, z.actions[0][:3] + (Action("B", 0, 0),)))
    i = interleaved_1f1b(1, 1, 2)  # F0s0 F0s1 B0s1 B0s0: stages 0, 1 share rank 0
    with pytest.raises(ScheduleError, match=r"rank 0, step 1 \(SEND_F0s0->0\): .*local"):
        validate(replace(i, 0, i.actions[0][:1] + (Action("SEND_F", 0, 0, peer=0),)
                         + i.actions[0][1:]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 0 \(F0s1\): needs the output of F0s0"):
        validate(replace(i, 0, [i.actions[0][k] for k in (1, 0, 2, 3)]))
    g = gpipe(2, 1)  # rank 0: F0 SEND_F0 RECV_B0 B0
    with pytest.raises(ScheduleError, match=r"rank 0, step 1 \(SEND_F0s0->1\): rank 1 has no "
                                            r"matching RECV_F; add RECV_F0s0<-0 to its list"):
        validate(replace(g, 1, g.actions[1][1:]))
    with pytest.raises(ScheduleError, match=r"rank 1, step 0 \(RECV_F0s0<-0\): rank 0 has no "
                                            r"matching SEND_F; add SEND_F0s0->1 to its list"):
        validate(replace(g, 0, g.actions[0][:1] + g.actions[0][2:]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 0 \(F1s0\): microbatch must be in 0..0"):
        validate(replace(g, 0, (Action("F", 1, 0),) + g.actions[0]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 2 \(F1s0\): 2 activations alive on "
                                            r"this rank, more than max_in_flight=1"):
        validate(one_f_one_b(2, 2), max_in_flight=1)
    with pytest.raises(ValueError, match="max_in_flight must be None or an integer >= 1"):
        validate(g, max_in_flight=0)
