"""Rows, tables and JSON output shared by the benchmarks."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, Sequence

from cfx._src.core.text import format_table


def size_of(*, quick: bool = False, smoke: bool = False) -> str:
    """A bench's one size knob, from its ``run`` flags (the command line's ``--quick`` / ``--smoke``).

    ``"full"``: the figures the README quotes; ``"quick"``: under a minute on 2 CPU cores;
    ``"smoke"``: the bench's code once through at toy sizes, in seconds, for the test suite (a
    measurement repeated over a list -- plans, methods, mesh sizes -- runs for one or two of
    them); its numbers, timings above all, mean nothing.
    """
    if quick and smoke:
        raise ValueError("a bench runs at one size: pass quick=True (--quick) or smoke=True (--smoke), "
                         "not both.")
    return "smoke" if smoke else "quick" if quick else "full"


@dataclasses.dataclass
class Row:
    metric: str
    value: float
    unit: str
    target: str = ""
    ok: bool = True


def _row_json(r: Row) -> dict:
    # the JSON says float and bool whatever number the bench computed (an int count, a numpy bool)
    return dict(dataclasses.asdict(r), value=float(r.value), ok=bool(r.ok))


def skipped(metric: str, target: str = "", why: str = "no CUDA device") -> Row:
    """A row that was not measured: value 0, ok False (never passing), the reason in its unit."""
    return Row(metric, 0.0, f"skipped: {why}", target, False)


def _verdict(r: Row) -> str:
    return "yes" if r.ok else "skip" if r.unit.startswith("skipped") else "NO"


def write_json(bench: str, rows: Sequence[Row], json_path: str) -> dict:
    """The rows as the benches' JSON (``{"bench", "rows"}``), written to ``json_path``; returned."""
    out = {"bench": bench, "rows": [_row_json(r) for r in rows]}
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def report(bench: str, rows: Sequence[Row], json_path: str | None = None) -> dict:
    out = {"bench": bench, "rows": [_row_json(r) for r in rows]}
    print(format_table([(r.metric, r.value, r.unit, r.target or "-", _verdict(r)) for r in rows],
                       ["metric", "value", "unit", "target", "ok"]), flush=True)
    if json_path:
        write_json(bench, rows, json_path)
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


def lockstep_medians(fns: Sequence[Callable[[], None]], rounds: int, warmup: int = 1) -> list[float]:
    """In each process of a ``torch.distributed`` world: every function's median step time over
    ``rounds``, where each call starts on all processes together (after a barrier) and lasts as
    long as its slowest process (a max-reduction at the end). Functions run in alternating order
    round after round. Timed this way, a side whose ranks synchronise at the end of a step and a
    side whose fast ranks run ahead into whatever is called next are measured alike: no rank's
    unfinished tail is charged to the next call."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        for f in fns:
            dist.barrier()
            f()
    times = torch.zeros(len(fns), rounds, dtype=torch.float64)
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            dist.barrier()
            t0 = time.perf_counter()
            fns[i]()
            times[i, r] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a round lasts as long as its slowest process
    return [statistics.median(row.tolist()) for row in times]


def end_worker() -> None:
    """End a spawned benchmark process at once, after its results are written and its process
    group destroyed. Interpreter finalization races gloo's worker threads, which may still be
    releasing a finished collective's tensors (they need the GIL): about one exit in ten of the
    ZeRO-3/FSDP2 workers aborted there ("terminate called without an active exception",
    pytorch/pytorch#179291). Skipping finalization leaves nothing undone: the process is over."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a bench or test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
