"""``cfx.pipeline.trace()``: the measured timeline of pipeline steps, per rank and action.

While a ``PipelineTrace`` is active (``with cfx.pipeline.trace() as tr:``; ``Mesh.run`` hands
the caller's context to its rank threads, so ranks see it), every pipeline step records each
action it runs as ``(action, start, end)`` with ``time.perf_counter`` times. ``tr.timeline()``
turns one step of one pipeline (the ranks sharing all coordinates but the pipe axis) into the
same ``Timeline`` that ``simulate`` returns, times in seconds from that step's first action, so
``bubble_fraction``, ``grid`` and ``plot`` work on measured runs too. Messages are recorded but,
as in the simulator, only compute (F/B/I/W) counts as busy: waiting in a RECV is bubble.

Under the ``dist`` backend each process records only its own ranks; a measured timeline needs
every rank of the pipeline in one process (the ``local`` backend).
"""
from __future__ import annotations

import dataclasses
import threading

from cfx._src.core import context
from cfx._src.pipeline.schedule import COMPUTE, Action, Schedule
from cfx._src.pipeline.simulate import Timeline

_traces = context.Collectors("cfx_pipeline_trace")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One rank's run of one pipeline step."""

    rank: int                 # global mesh rank
    pipe_index: int           # position along the pipe axis
    group: tuple              # coordinates on the other mesh axes: which pipeline
    step: int                 # this rank's step count within the trace, from 0
    schedule: Schedule
    events: tuple[tuple[Action, float, float], ...]  # every action, in order


class PipelineTrace(context.Collector):
    """Collects ``StepRecord``s from pipeline steps run while it is active."""

    stack = _traces

    def __init__(self):
        self.records: list[StepRecord] = []
        self._lock = threading.Lock()

    def _add(self, rank, pipe_index, group, schedule, events) -> None:
        with self._lock:
            step = sum(1 for r in self.records if r.rank == rank)
            self.records.append(StepRecord(rank, pipe_index, tuple(group), step, schedule,
                                           tuple(events)))

    def steps(self) -> int:
        """Steps recorded by every rank."""
        ranks = {r.rank for r in self.records}
        return min((sum(1 for r in self.records if r.rank == k) for k in ranks), default=0)

    def timeline(self, *, step: int = -1, group: tuple | None = None) -> Timeline:
        """The measured ``Timeline`` of one step (default: the last) of one pipeline (default:
        the one holding the lowest global rank), times in seconds."""
        n = self.steps()
        if n == 0:
            raise ValueError("PipelineTrace.timeline: no pipeline step was recorded; run a step "
                             "inside `with cfx.pipeline.trace() as tr:`.")
        if not -n <= step < n:
            raise ValueError(f"PipelineTrace.timeline: step={step} but {n} steps were recorded.")
        step %= n
        if group is None:
            group = min(self.records, key=lambda r: r.rank).group
        recs = sorted((r for r in self.records if r.step == step and r.group == tuple(group)),
                      key=lambda r: r.pipe_index)
        if not recs:
            groups = sorted({r.group for r in self.records})
            raise ValueError(f"PipelineTrace.timeline: no pipeline with group={group!r}; "
                             f"recorded groups are {groups}.")
        sched = recs[0].schedule
        if [r.pipe_index for r in recs] != list(range(sched.n_ranks)):
            raise ValueError(f"PipelineTrace.timeline: step {step} of group {group!r} has records "
                             f"from pipe positions {[r.pipe_index for r in recs]}, not all "
                             f"{sched.n_ranks}; under the dist backend each process sees only "
                             f"its own ranks.")
        t0 = min(ev[0][1] for ev in (r.events for r in recs) if ev)
        events = tuple(tuple((a, s - t0, e - t0) for a, s, e in r.events if a.kind in COMPUTE)
                       for r in recs)
        makespan = max((e - t0 for r in recs for _, _, e in r.events), default=0.0)
        return Timeline(sched, events, makespan)


def trace() -> PipelineTrace:
    """A collector; use as ``with cfx.pipeline.trace() as tr:`` and read ``tr.timeline()``."""
    return PipelineTrace()


def active() -> tuple:
    return _traces.active()
