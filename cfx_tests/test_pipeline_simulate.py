"""Simulated timelines reproduce the textbook bubbles exactly; grid and plot draw every action."""
import re
from collections import Counter

import matplotlib
import pytest

from cfx._src.pipeline.render import grid, label, plot
from cfx._src.pipeline.schedule import Action, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from cfx._src.pipeline.simulate import simulate
from cfx._src.pipeline.validate import ScheduleError

matplotlib.use("Agg")
UNIT = {"F": 1, "B": 1}


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble(gen):
    for p in (1, 2, 3, 4):
        for m in range(1, 17):
            tl = simulate(gen(p, m), cost=UNIT)
            assert tl.makespan == 2 * (m + p - 1)
            assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
            assert tl.bubble_ratio == pytest.approx((p - 1) / m)
            assert all(tl.busy(r) == 2 * m for r in range(p))


def test_interleaved_bubble():
    # F = B = 1 per chunk: idle per rank 2(p-1), compute 2*m*v -> ratio (p-1)/(v*m), exactly.
    for p in (1, 2, 3, 4):
        for v in (1, 2, 3):
            for m in range(p, 17, p):
                tl = simulate(interleaved_1f1b(p, m, v), cost=UNIT)
                assert tl.bubble_ratio == pytest.approx((p - 1) / (v * m))
                assert tl.makespan == 2 * (m * v + p - 1)


# Exact figures (F = B = 1 for GPipe/1F1B/interleaved v=2; ZB-H1 with F = I = W = 1 against
# 1F1B with F = 1, B = 2): (p, m) -> (1F1B fraction, interleaved v=2 ratio, ZB-H1 ratio,
# 1F1B B=2 ratio). ZB-H1's idle is exactly 1/3 of 1F1B's: (p-1) against 3(p-1) per rank.
FIGURES = {
    (2, 4): (1 / 5, 1 / 8, 1 / 12, 1 / 4), (2, 8): (1 / 9, 1 / 16, 1 / 24, 1 / 8),
    (2, 16): (1 / 17, 1 / 32, 1 / 48, 1 / 16), (4, 4): (3 / 7, 3 / 8, 1 / 4, 3 / 4),
    (4, 8): (3 / 11, 3 / 16, 1 / 8, 3 / 8), (4, 16): (3 / 19, 3 / 32, 1 / 16, 3 / 16),
}


@pytest.mark.parametrize("p,m", list(FIGURES))
def test_textbook_figures(p, m):
    f1b, il, zb, f1b3 = FIGURES[p, m]
    assert simulate(gpipe(p, m), cost=UNIT).bubble_fraction == pytest.approx(f1b)
    assert simulate(one_f_one_b(p, m), cost=UNIT).bubble_fraction == pytest.approx(f1b)
    assert simulate(interleaved_1f1b(p, m, 2), cost=UNIT).bubble_ratio == pytest.approx(il)
    z, o = simulate(zb_h1(p, m)), simulate(one_f_one_b(p, m))  # defaults: F=I=W=1, B=2
    assert (z.bubble_ratio, o.bubble_ratio) == (pytest.approx(zb), pytest.approx(f1b3))
    assert z.idle / o.idle == pytest.approx(1 / 3)
    assert (z.idle, o.idle) == (pytest.approx(p * (p - 1)), pytest.approx(3 * p * (p - 1)))
    assert (z.makespan, o.makespan) == (3 * m + p - 1, 3 * (m + p - 1))


def test_zb_h1_with_few_microbatches():
    # m < p: the ratio of idle times is above 1/3 (too few W's to fill the tail).
    ratios = {m: simulate(zb_h1(4, m)).idle / simulate(one_f_one_b(4, m)).idle
              for m in (1, 2, 3)}
    assert ratios == pytest.approx({1: 2 / 3, 2: 5 / 9, 3: 4 / 9})


def test_in_flight_peaks():
    for p in (1, 2, 4):
        for m in range(1, 17):
            assert simulate(one_f_one_b(p, m)).peak_in_flight(0) == min(p, m)
            assert simulate(gpipe(p, m)).peak_in_flight(0) == m
            z = simulate(zb_h1(p, m))
            assert z.peak_in_flight(0) == z.peak_in_flight(0, release="W") == min(p, m)


def test_costs():
    s = gpipe(4, 3)
    by_map = simulate(s, cost={"F": 1.5, "B": 2.5})
    by_fn = simulate(s, cost=lambda a: {"F": 1.5, "B": 2.5}.get(a.kind, 0.0))
    assert by_map == by_fn
    assert by_map.makespan == pytest.approx((3 + 3) * (1.5 + 2.5))  # (m + p - 1)(F + B)
    for latency in (0.5, 2.0):  # GPipe's critical path crosses 2(p-1) links
        tl = simulate(s, cost={"F": 1, "B": 1, "SEND_F": latency, "SEND_B": latency})
        assert tl.makespan == pytest.approx(2 * (3 + 4 - 1) + 2 * 3 * latency)
    assert simulate(zb_h1(1, 5)).bubble_fraction == 0
    with pytest.raises(ValueError, match=r"unknown cost kinds \['X'\]"):
        simulate(s, cost={"X": 1})
    with pytest.raises(ValueError, match=r"cost of F0s0 must be a real number >= 0"):
        simulate(s, cost={"F": -1})


def test_simulate_validates():
    s = gpipe(2, 1)
    bad = type(s)(s.name, 2, 1, 1, (s.actions[0], s.actions[1][1:]))
    with pytest.raises(ScheduleError, match=r"rank 0, step 1 \(SEND_F0s0->1\)"):
        simulate(bad)


@pytest.mark.parametrize("sched", [gpipe(3, 4), one_f_one_b(4, 8), zb_h1(4, 6),
                                   interleaved_1f1b(2, 4, 3), interleaved_1f1b(1, 2, 2)],
                         ids=lambda s: f"{s.name}-p{s.n_ranks}-v{s.n_chunks}")
def test_grid_shows_every_action_once(sched):
    text = grid(sched)
    rows = text.splitlines()[2:]
    assert len(rows) == sched.n_ranks
    for r, row in enumerate(rows):
        cells = row.split("|")[1].split()
        assert Counter(c for c in cells if c != ".") == \
            Counter(label(a, sched) for a in sched.compute_actions(r))
        assert len(cells) == simulate(sched, cost={"F": 1, "B": 1}).makespan
    if sched.n_chunks > 1:
        assert re.search(r"F0\.1", text)


def test_grid_of_timeline_spans_durations():
    tl = simulate(one_f_one_b(2, 2))  # B = 2: two cells each
    rows = grid(tl).splitlines()[2:]
    assert rows[0].split("|")[1].split() == ["F0", "F1", ".", ".", "B0", "B0", ".", "B1", "B1"]
    assert rows[1].split("|")[1].split() == [".", "F0", "B0", "B0", "F1", "B1", "B1", ".", "."]


def test_plot():
    import matplotlib.pyplot as plt

    tl = simulate(zb_h1(4, 8))
    ax = plot(tl)
    try:
        assert len(ax.get_yticks()) == 4
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
        assert len(ax.patches) == sum(len(tl.schedule.compute_actions(r)) for r in range(4))
        assert ax.get_xlim() == (0, tl.makespan)
    finally:
        plt.close(ax.figure)
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    assert plot(interleaved_1f1b(2, 4, 2), ax=ax) is ax
    assert len(ax.patches) == 2 * 2 * 4 * 2
    with pytest.raises(ValueError, match="expected a Schedule or a Timeline"):
        plot(Action("F", 0, 0), ax=ax)
