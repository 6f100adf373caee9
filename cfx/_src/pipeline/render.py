"""Pictures of a schedule: a text grid (``grid``) and a matplotlib Gantt chart (``plot``).

Labels: kind + microbatch (``F0``, ``B3``, ``I1``, ``W2``); with v > 1 chunks the chunk follows a
dot (``F0.1`` is microbatch 0 on the rank's chunk 1, i.e. stage rank + p). Messages take no time
on a rank and are not drawn.
"""
from __future__ import annotations

from cfx._src.pipeline.schedule import Action, Schedule
from cfx._src.pipeline.simulate import Timeline, simulate

UNIT_COST = {"F": 1, "B": 1, "I": 1, "W": 1}
COLOURS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}


def label(action: Action, schedule: Schedule) -> str:
    """``F3`` for v = 1, ``F3.1`` (microbatch 3, chunk 1) for interleaved schedules."""
    text = f"{action.kind}{action.microbatch}"
    if schedule.n_chunks > 1:
        text += f".{action.stage // schedule.n_ranks}"
    return text


def _timeline(x: Schedule | Timeline) -> Timeline:
    if isinstance(x, Timeline):
        return x
    if isinstance(x, Schedule):
        return simulate(x, cost=UNIT_COST)
    raise ValueError(f"expected a Schedule or a Timeline, got {type(x).__name__}; build one with "
                     f"a schedule generator or simulate().")


def grid(x: Schedule | Timeline, *, unit: float | None = None) -> str:
    """Text chart, one row per rank, one column per time slot of length ``unit``; ``.`` is idle.

    A Schedule is drawn as simulated with every compute action costing 1 (one cell each); a
    Timeline with its own costs, ``unit`` defaulting to its shortest action, so an action spans
    round(duration / unit) cells, each showing its label. A cell shows the action running at
    the slot's midpoint.
    """
    tl = _timeline(x)
    sched, p = tl.schedule, tl.schedule.n_ranks
    durations = [end - start for ev in tl.events for _, start, end in ev if end > start]
    if unit is None:
        unit = min(durations, default=1.0)
    if unit <= 0:
        raise ValueError(f"grid: unit must be > 0, got {unit!r}.")
    n_slots = round(tl.makespan / unit)
    cells = [["."] * n_slots for _ in range(p)]  # (p, n_slots)
    for r in range(p):
        for a, start, end in tl.events[r]:
            for k in range(n_slots):
                if start <= (k + 0.5) * unit < end:
                    cells[r][k] = label(a, sched)
    width = max([len(c) for row in cells for c in row] + [len(str(max(n_slots - 1, 0)))])
    head = " " * len(f"rank {p - 1} |") + " " + " ".join(f"{k:>{width}}" for k in range(n_slots))
    rows = [f"rank {r:>{len(str(p - 1))}} | " + " ".join(f"{c:>{width}}" for c in cells[r])
            for r in range(p)]
    return "\n".join([f"{sched.name}: p={p} m={sched.n_microbatches} v={sched.n_chunks}",
                      head] + rows)


def plot(x: Schedule | Timeline, ax=None):
    """Gantt chart on matplotlib axes ``ax`` (a new figure when None): one row per rank, rank 0 on
    top, one bar per compute action coloured by kind and labelled with its microbatch (and
    chunk). Returns the axes. A Schedule is drawn with unit costs, as in ``grid``."""
    from matplotlib.patches import Patch  # lazily: only drawing needs matplotlib

    tl = _timeline(x)
    sched = tl.schedule
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(max(6.0, 0.35 * tl.makespan), 0.6 * sched.n_ranks + 1))
    for r, events in enumerate(tl.events):
        for a, start, end in events:
            ax.barh(r, end - start, left=start, height=0.8, color=COLOURS[a.kind],
                    edgecolor="black", linewidth=0.5)
            ax.text((start + end) / 2, r, label(a, sched)[1:], ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(sched.n_ranks), [f"rank {r}" for r in range(sched.n_ranks)])
    ax.set_ylim(sched.n_ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, tl.makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{sched.name}: p={sched.n_ranks} m={sched.n_microbatches} "
                 f"v={sched.n_chunks}, bubble {tl.bubble_fraction:.1%}")
    kinds = sorted({a.kind for ev in tl.events for a, _, _ in ev}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return ax
