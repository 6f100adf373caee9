"""``comm_stats()``: count every collective's calls and bytes, per op, axis and rank."""
from __future__ import annotations

import collections
import dataclasses
import threading

from cfx._src.core import context
from cfx._src.core.text import format_table
from cfx._src.lax import groups


@dataclasses.dataclass(frozen=True)
class CommRecord:
    rank: int
    op: str            # all_reduce | all_gather | reduce_scatter | all_to_all | ragged_all_to_all | ppermute
    axes: tuple[str, ...]
    numel: int         # payload elements this rank contributed
    nbytes: int        # payload bytes this rank contributed
    backward: bool     # issued by the autograd engine during a backward pass


class CommStats(context.Collector):
    """Collects ``CommRecord``s while active (``with cfx.comm_stats() as stats: ...``).

    Covers collectives issued by shard_map bodies launched inside the ``with`` block (on every
    rank this process drives) and by code running inside a rank.
    """

    stack = groups.collectors

    def __init__(self):
        self.records: list[CommRecord] = []
        self._lock = threading.Lock()

    def record(self, rank, op, axes, numel, nbytes, backward) -> None:
        with self._lock:
            self.records.append(CommRecord(rank, op, tuple(axes), numel, nbytes, backward))

    def select(self, *, op: str | None = None, axes=None, rank: int | None = None,
               backward: bool | None = None) -> list[CommRecord]:
        if isinstance(axes, str):
            axes = (axes,)
        return [r for r in self.records
                if (op is None or r.op == op) and (axes is None or r.axes == tuple(axes))
                and (rank is None or r.rank == rank) and (backward is None or r.backward == backward)]

    def count(self, **where) -> int:
        return len(self.select(**where))

    def bytes(self, **where) -> int:
        return sum(r.nbytes for r in self.select(**where))

    def sent(self) -> dict[str, dict[str, int]]:
        """Payload bytes per mesh axes (joined by ".") and phase (``"forward"``, which includes the
        optimizer's, or ``"backward"``): a rank's sum over its records, the most of any rank (what
        ``Plan.describe(batch=)`` reports of the step rehearsed on shapes)."""
        per: collections.Counter = collections.Counter()
        for r in self.records:
            per[(r.rank, ".".join(r.axes), "backward" if r.backward else "forward")] += r.nbytes
        out: dict[str, dict[str, int]] = {}
        for (_, axes, phase), b in per.items():
            by = out.setdefault(axes, {})
            by[phase] = max(by.get(phase, 0), b)
        return out

    def summary(self) -> list[tuple]:
        """Rows ``(axes, op, phase, calls per rank, payload bytes per rank)`` (max over ranks)."""
        agg = collections.defaultdict(lambda: collections.Counter())
        for r in self.records:
            key = (".".join(r.axes), r.op, "backward" if r.backward else "forward")
            agg[key][("calls", r.rank)] += 1
            agg[key][("bytes", r.rank)] += r.nbytes
        rows = []
        for key in sorted(agg):
            c = agg[key]
            calls = max(v for (k, _), v in c.items() if k == "calls")
            nbytes = max(v for (k, _), v in c.items() if k == "bytes")
            rows.append((*key, calls, nbytes))
        return rows

    def table(self) -> str:
        return format_table(self.summary(), ["axes", "op", "phase", "calls/rank", "bytes/rank"])


def comm_stats() -> CommStats:
    return CommStats()
