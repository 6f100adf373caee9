"""A pipeline schedule's time and memory for the estimate: ``cfx.pipeline``'s own schedules run by its
simulator under a step's per-stage costs (``makespan``), and the microbatches a rank keeps in flight
(``in_flight``).

The schedules are the generators' (``cfx.pipeline.schedule``), which the tests ``validate`` at every size
they draw (``test_pipeline_schedule``, and here ``test_estimate``'s draws); the estimate does not validate
them again -- it builds schedules of 64 stages and hundreds of microbatches, where checking one took
longer than the rest of the estimate -- and ``clock_order`` still refuses one that would stall."""
from __future__ import annotations

import functools

from cfx._src.pipeline import schedule as S
from cfx._src.pipeline.schedule import KINDS, Schedule
from cfx._src.pipeline.simulate import clock_order


@functools.lru_cache(maxsize=64)
def schedule_of(name: str, p: int, m: int, v: int):
    """The plan's schedule (``cfx.pipeline``'s generator's, module doc), built once: the estimate runs it under
    many costs."""
    if name == "gpipe":
        out = S.gpipe(p, m)
    elif name == "zb-h1":
        out = S.zb_h1(p, m)
    elif name == "interleaved" or v > 1:
        out = S.interleaved_1f1b(p, m, v)
    else:
        out = S.one_f_one_b(p, m)
    return out


class Program:
    """A generator's schedule under costs by kind: ``clock_order``'s steps (the simulator's order) as
    ``(rank, cost slot, op, message)`` -- the slot the kind's index in ``KINDS``, plus ``len(KINDS)`` on
    the last stage (the head). ``makespan`` then does ``run_validated``'s arithmetic, in its order, with
    none of its bookkeeping: a search runs thousands of these (measured: 5x faster; bit for bit its
    makespan, ``test_estimate``)."""

    def __init__(self, schedule: Schedule):
        self.p, last, n = schedule.n_ranks, schedule.n_stages - 1, len(KINDS)
        slot = {k: i for i, k in enumerate(KINDS)}
        self.ops, self.n_messages = [], 0
        for r, i, op, msg in clock_order(schedule):
            a = schedule.actions[r][i]
            self.ops.append((r, slot[a.kind] + (n if a.stage == last else 0), op, msg))
            self.n_messages += op == 1

    def makespan(self, costs: list[float]) -> float:
        """``run_validated(schedule, cost).makespan`` where ``cost(a)`` is ``costs[slot of a]`` (class doc)."""
        clock, arrival = [0.0] * self.p, [0.0] * self.n_messages
        for r, slot, op, msg in self.ops:
            if op == 0:
                clock[r] += costs[slot]
            elif op == 1:
                arrival[msg] = clock[r] + costs[slot]
            else:
                c, t = clock[r], arrival[msg]
                clock[r] = (c if c >= t else t) + costs[slot]
        return max(clock)


@functools.lru_cache(maxsize=64)
def program_of(name: str, p: int, m: int, v: int) -> Program:
    return Program(schedule_of(name, p, m, v))


@functools.lru_cache(maxsize=256)
def in_flight(name: str, p: int, m: int, v: int) -> int:
    """Chunk activations rank 0 (the fullest) holds at once under the schedule."""
    m = min(m, 2 * p * v + p)   # the peak is reached within the first rounds
    if name == "interleaved" or v > 1:
        m = max(p, m // p * p)
    return schedule_of(name, p, m, v).peak_in_flight(0)


def makespan(name: str, p: int, m: int, v: int, f: float, b: float, hf: float, hb: float, send: float) -> float:
    """The makespan of the schedule with a chunk's forward ``f`` and backward ``b`` (the last stage
    adds the head's ``hf`` / ``hb``; ZB-H1's I and W half a backward each), each message ``send`` s
    (``cfx.pipeline``'s simulator). A makespan scales with its costs, so it is simulated for the costs
    over ``f`` (each ratio to 4 significant digits: within 0.05%) and remembered: a search asks for the
    same schedule under the same ratios for every ZeRO stage and sequence method of a mesh."""
    if f <= 0:
        return _span(name, p, m, v, f, b, hf, hb, send)
    key = tuple(float(f"{x / f:.4g}") for x in (b, hf, hb, send))
    return f * _span_ratios(name, p, m, v, *key)


@functools.lru_cache(maxsize=4096)
def _span_ratios(name: str, p: int, m: int, v: int, b: float, hf: float, hb: float, send: float) -> float:
    return _span(name, p, m, v, 1.0, b, hf, hb, send)


def _span(name: str, p: int, m: int, v: int, f: float, b: float, hf: float, hb: float, send: float) -> float:
    """``makespan``, simulated. A long run is simulated for ``n`` and ``n + p`` microbatches
    (``n``: ``(v + 1) p`` and the remainder of ``m`` over ``p``) and each further group of ``p`` adds what
    the last added: the schedule's steady state, in which every rank repeats one pattern per group of
    ``p`` microbatches (exact in nearly every case, within 0.3% of the whole simulation where a message
    takes at most half a chunk's forward; about 1% off for interleaved 1F1B with messages of twice a
    forward: ``test_estimate``)."""
    plain = {"F": f, "B": b, "I": b / 2, "W": b / 2, "SEND_F": send, "SEND_B": send, "RECV_F": 0.0, "RECV_B": 0.0}
    head = dict(plain, F=f + hf, B=b + hb, I=(b + hb) / 2, W=(b + hb) / 2)

    costs = [plain[k] for k in KINDS] + [head[k] for k in KINDS]

    def span(k: int) -> float:
        return program_of(name, p, k, v).makespan(costs)

    n = (v + 1) * p + m % p
    if m <= n + p:
        return span(m)
    one, two = span(n), span(n + p)
    return two + (m - n - p) // p * (two - one)


def clear_caches() -> None:
    """Forget every schedule, compiled program and makespan remembered (a timing that wants a first call)."""
    for fn in (schedule_of, program_of, in_flight, _span_ratios):
        fn.cache_clear()
