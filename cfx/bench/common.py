"""Rows, tables and JSON output shared by the benchmarks."""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Callable, Sequence

from cfx._src.table import format_table


@dataclasses.dataclass
class Row:
    metric: str
    value: float
    unit: str
    target: str = ""
    ok: bool = True


def report(bench: str, rows: Sequence[Row], json_path: str | None = None) -> dict:
    out = {"bench": bench, "rows": [dataclasses.asdict(r) for r in rows]}
    print(format_table([(r.metric, r.value, r.unit, r.target or "-", "yes" if r.ok else "NO") for r in rows],
                       ["metric", "value", "unit", "target", "ok"]), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def interleaved_medians(fns: Sequence[Callable[[], None]], rounds: int, warmup: int = 1) -> list[float]:
    """Median wall time of each function, run in alternating order round after round."""
    for _ in range(warmup):
        for f in fns:
            f()
    times = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]
