"""``simulate``: when each action of a (validated) schedule starts and ends, given its cost.

Each rank runs its list in order and is busy during compute only. A compute action starts when
the rank is free; its data is already there, because the RECV that brings it comes earlier in
the list (``validate`` guarantees it). A SEND does not hold the sender: its data reaches the peer
``cost(SEND)`` later (the link latency, default 0). A RECV holds its rank until that moment, then
for ``cost(RECV)`` (default 0). The result is a ``Timeline``.

Bubble, with ``idle = p * makespan - total compute``:
  bubble_fraction = idle / (p * makespan)   the idle share of the timeline
  bubble_ratio    = idle / total compute    the "relative" bubble of the papers, e.g. (p-1)/m
With F = B = 1: GPipe and 1F1B give fraction (p-1)/(m+p-1), ratio (p-1)/m; interleaved 1F1B
(F = B = 1 per chunk) ratio (p-1)/(v*m); with the default F = I = W = 1, ZB-H1's idle per rank
is p-1 against 1F1B's 3(p-1) with B = 2 (for m >= p).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Mapping, Union

from cfx._src.pipeline.schedule import KINDS, Action, Schedule
from cfx._src.pipeline.validate import validate

DEFAULT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0,
                "SEND_F": 0.0, "RECV_F": 0.0, "SEND_B": 0.0, "RECV_B": 0.0}
Cost = Union[None, Mapping[str, float], Callable[[Action], float]]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Simulated execution: ``events[r]`` lists rank r's compute actions as (action, start, end)."""

    schedule: Schedule
    events: tuple[tuple[tuple[Action, float, float], ...], ...]  # (p,) per-rank, in order
    makespan: float

    def busy(self, rank: int) -> float:
        """Time ``rank`` spends computing."""
        return sum(end - start for _, start, end in self.events[rank])

    @property
    def idle(self) -> float:
        """Idle compute time summed over ranks."""
        p = self.schedule.n_ranks
        return p * self.makespan - sum(self.busy(r) for r in range(p))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the p x makespan timeline."""
        total = self.schedule.n_ranks * self.makespan
        return self.idle / total if total else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (the relative bubble)."""
        work = sum(self.busy(r) for r in range(self.schedule.n_ranks))
        return self.idle / work if work else 0.0

    def peak_in_flight(self, rank: int, *, release: str = "I") -> int:
        """Most activations alive at once on ``rank``: +1 at F, -1 at B or ``release`` (I by
        default, as the validator counts). The order alone decides it (a rank runs one action
        at a time), so this is ``schedule.peak_in_flight``."""
        return self.schedule.peak_in_flight(rank, release=release)


def _cost_fn(cost: Cost) -> Callable[[Action], float]:
    if callable(cost):
        return cost
    table = dict(DEFAULT_COST)
    if cost is not None:
        unknown = set(cost) - set(KINDS)
        if unknown:
            raise ValueError(f"simulate: unknown cost kinds {sorted(unknown)}; use keys from "
                             f"{KINDS}.")
        table.update(cost)
    return lambda a: table[a.kind]


def simulate(schedule: Schedule, *, cost: Cost = None) -> Timeline:
    """Runs ``schedule`` on a clock. ``cost``: None (F=1, B=2, I=1, W=1, messages 0), a mapping
    kind -> time over those defaults, or a callable ``cost(action) -> time``."""
    validate(schedule)
    return run_validated(schedule, _cost_fn(cost))


def clock_order(schedule: Schedule) -> tuple[tuple[int, int, int, int], ...]:
    """Every action of a validated schedule in the order the clock takes them (each rank its list in
    turn until a RECV whose SEND has not been issued; it depends on the lists, not on the costs), as
    ``(rank, index in its list, op, message)``: op 0 compute, 1 send, 2 receive; ``message`` numbers
    the sends, a receive naming its send's."""
    p = schedule.n_ranks
    pos, sent, steps = [0] * p, {}, []
    moved = True
    while moved:
        moved = False
        for r in range(p):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                key = (a.kind[-1], a.stage, a.microbatch)
                if a.kind.startswith("RECV"):
                    if key not in sent:
                        break  # its SEND is later on another rank's clock
                    steps.append((r, pos[r], 2, sent[key]))
                elif a.kind.startswith("SEND"):
                    sent[key] = len(sent)
                    steps.append((r, pos[r], 1, sent[key]))
                else:
                    steps.append((r, pos[r], 0, 0))
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(schedule.actions[r]) for r in range(p)), "validated, cannot stall"
    return tuple(steps)


def run_validated(schedule: Schedule, duration: Callable[[Action], float]) -> Timeline:
    """``simulate`` of a schedule ``validate`` has passed (a caller that runs one schedule under many
    costs validates it once), ``duration(action)`` its cost."""
    p = schedule.n_ranks
    steps = clock_order(schedule)
    clock, arrival = [0.0] * p, [0.0] * sum(op == 1 for _, _, op, _ in steps)
    events: list[list] = [[] for _ in range(p)]
    for r, i, op, msg in steps:
        a = schedule.actions[r][i]
        t = duration(a)
        if type(t) is not float and not isinstance(t, numbers.Real) or t < 0:
            raise ValueError(f"simulate: cost of {a} must be a real number >= 0, got {t!r}.")
        if op == 2:
            clock[r] = max(clock[r], arrival[msg]) + t
        elif op == 1:
            arrival[msg] = clock[r] + t
        else:
            events[r].append((a, clock[r], clock[r] + t))
            clock[r] += t
    makespan = max(clock)
    return Timeline(schedule, tuple(tuple(ev) for ev in events), makespan)
