"""The seeds' headline measured: the largest GPT-2 each way trains under one memory cap.

``python -m cfx.bench capacity [--cap 2GiB] [--dir DIR] [--smoke] [--json FILE]``. Every candidate
runs as its own process (``capacity_worker``) inside a memory cgroup this bench creates and removes
(``cgroup``: memory and memory+swap capped), trains 3 AdamW steps (fp32 state, batch 1, sequence
128) of a GPT-2 shape from a fixed ladder, and counts as trained only if it exits cleanly, not killed:

* ``pytorch``: transformers' ``GPT2LMHeadModel`` with ``torch.optim.AdamW``, climbing the ladder until
  a size is killed;
* ``cfx``: ``cfx.parallel.Program("data=1 zero=3 remat=blocks")``, everything in memory, the same way;
* ``nvme``: ``cfx.zero.GeminiEngine.from_init`` with ``offload(host(), nvme_dir=DIR)`` -- params,
  gradients and Adam moments in files, streamed -- from the top of the ladder down to the first that trains.

Memory is the peak of the group's anonymous memory (``cgroup``), not page cache. The directory's
sequential bandwidth is measured first (``O_DIRECT`` where the filesystem takes it); the largest
nvme run's last step is set against it: bytes read and written / bandwidth, over the seconds its
reads and writes took (``io_efficiency``), and its step time over that lower bound. A small model
is trained twice more, uncapped in memory and capped in files, and must match bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

from cfx.bench import cgroup
from cfx.bench.common import Row, report, size_of

GiB, MiB = 1 << 30, 1 << 20

# GPT-2 shapes (width, layers; heads = width / 64; vocab 50257, 1024 positions): up to the family's small
# and medium, then medium's width at growing depth (30M, 51M, 82M, 124M, 355M, 657M, 1.26B, 1.87B, 2.57B).
# Depth, not width: what streaming holds at once is a chunk, at least the tied embedding (50257 x width)
LADDERS = {
    "full": dict(ladder=[(384, 6), (512, 8), (640, 10), (768, 12), (1024, 24), (1024, 48), (1024, 96),
                         (1024, 144), (1024, 200)], vocab=50257, seq=128, cap=2 * GiB, same=(384, 6),
                 timeout=3600, probe=2 * GiB),
    # one size (each candidate is a process of its own: the suite's time), the equality pair included
    "smoke": dict(ladder=[(64, 1)], vocab=512, seq=16, cap=512 * MiB, same=(64, 1), timeout=300,
                  probe=64 * MiB),
}


# every candidate alike: blocks of 128 KiB and more come from mmap and go back to the system when freed,
# rather than fragmenting glibc's heaps (its default threshold grows to 32 MiB; a layer's activations at
# sequence 128 are ~0.5 MiB: under a 1 MiB threshold the streaming run's heap kept ~400 MiB of holes)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10), "MALLOC_ARENA_MAX": "2"}


def params_of(width: int, layers: int, vocab: int) -> int:
    """GPT-2's parameter count (tied head, 1024 positions)."""
    return layers * (12 * width * width + 13 * width) + vocab * width + 1024 * width + 2 * width


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.I)
    if not m:
        raise ValueError(f"--cap {text!r}: give bytes like 2GiB, 512MiB or 2147483648.")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def filesystem_of(path: str) -> str:
    """The filesystem type of ``path`` (the longest mount point above it in /proc/mounts)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype, *_ = line.split()
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def check_dir(directory: str) -> None:
    kind = filesystem_of(directory)
    if kind in ("tmpfs", "ramfs"):
        raise ValueError(f"--dir {directory!r} is on {kind}: its files are memory, charged to the very cap being "
                         "measured. Pass a directory on a disk (e.g. --dir /var/tmp/cfx-capacity).")


def disk_bandwidth(directory: str, nbytes: int, block: int = 64 * MiB) -> dict:
    """Sequential write then read bandwidth of ``directory`` (bytes/s), through ``O_DIRECT`` where the
    filesystem accepts it (else buffered with fsync, pages dropped before reading)."""
    path = os.path.join(directory, f".cfx-bandwidth-{os.getpid()}")
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (block >> 20))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:
            direct, fd = 0, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == block:
            pass
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    n = nbytes // block * block
    return {"write": n / write_s, "read": n / read_s, "direct": bool(direct)}


def run_one(cap: cgroup.MemoryCap | None, kind: str, shape, cfg: dict, work: str, *, digest: bool = False,
            log=sys.stderr) -> dict:
    """One candidate in its own process (under ``cap``, or uncapped when None): the worker's JSON plus
    how it ended (``trained``, ``anon_peak``, ``total_peak``, ``wall_s``)."""
    width, layers = shape
    out = os.path.join(work, f"{kind}-{width}x{layers}{'-capped' if cap else ''}.json")
    files = os.path.join(work, "state")
    argv = [sys.executable, "-m", "cfx.bench.capacity_worker", kind, str(width), str(layers),
            "--vocab", str(cfg["vocab"]), "--seq", str(cfg["seq"]), "--out", out, "--dir", files]
    if digest:
        argv.append("--digest")
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1), **MALLOC)
    print(f"{kind:>7} {width}x{layers} ({params_of(width, layers, cfg['vocab']) / 1e6:,.0f}M params)"
          f"{' under ' + format(cap.cap / GiB, '.2f') + ' GiB' if cap else ', uncapped'} ...", file=log, flush=True)
    try:
        if cap is None:
            import subprocess
            t0 = time.perf_counter()
            proc = subprocess.run(argv, env=env, timeout=cfg["timeout"])
            ended = cgroup.Capped(proc.returncode, False, -1, -1, time.perf_counter() - t0)
        else:
            ended = cap.run(argv, timeout=cfg["timeout"], env=env)
    finally:
        shutil.rmtree(files, ignore_errors=True)
    got = {}
    if os.path.exists(out):
        with open(out) as f:
            got = json.load(f)
    got.update(kind=kind, width=width, layers=layers)  # also for a run killed before it wrote anything
    got.update(trained=ended.ok and bool(got.get("done")), returncode=ended.returncode, oom_killed=ended.oom_killed,
               anon_peak=ended.anon_peak, total_peak=ended.total_peak, wall_s=ended.seconds,
               params=got.get("params", params_of(width, layers, cfg["vocab"])))
    verdict = "trained" if got["trained"] else ("killed (OOM)" if ended.oom_killed or ended.returncode == -9
                                                 else f"failed (exit {ended.returncode})")
    peak = f"anon peak {ended.anon_peak / MiB:,.0f} MiB" if ended.anon_peak >= 0 else "not capped"
    print(f"        {verdict}; {peak}, {ended.seconds:.0f} s", file=log, flush=True)
    return got


def climb(cap, kind: str, cfg: dict, work: str, runs: list) -> dict | None:
    """Up the ladder until a size does not train: the last one that did (None: not even the first)."""
    best = None
    for shape in cfg["ladder"]:
        got = run_one(cap, kind, shape, cfg, work)
        runs.append(got)
        if not got["trained"]:
            break
        best = got
    return best


def descend(cap, kind: str, cfg: dict, work: str, runs: list) -> dict | None:
    """Down the ladder from the top until a size trains: that one (None: none did). The size of the
    equality check runs with its digest (then it is that check's capped run too)."""
    for shape in reversed(cfg["ladder"]):
        got = run_one(cap, kind, shape, cfg, work, digest=tuple(shape) == tuple(cfg["same"]))
        runs.append(got)
        if got["trained"]:
            return got
    return None


def io_rows(best: dict, bw: dict) -> list[Row]:
    """The largest nvme run's last step against the directory's bandwidth."""
    io, step_s = best["io"][-1], best["step_s"][-1]
    bound = io["read_bytes"] / bw["read"] + io["write_bytes"] / bw["write"]
    spent = io["read_s"] + io["write_s"]
    moved = io["read_bytes"] + io["write_bytes"]
    return [
        Row("nvme_bytes_per_step", moved / GiB, "GiB read + written", "printed"),
        Row("io_lower_bound_s", bound, "s (bytes / measured bandwidth)", "printed"),
        Row("io_seconds_per_step", spent, "s in reads and writes", "printed"),
        Row("io_efficiency", bound / spent if spent else 0.0, "x (bound / I/O seconds)", ">= 0.67",
            spent > 0 and bound / spent >= 0.67),
        Row("nvme_step_s", step_s, "s", "printed"),
        Row("step_vs_io_bound", step_s / bound if bound else 0.0, "x", "printed"),
    ]


@contextlib.contextmanager
def _terminated_as_exit():
    """SIGTERM raises SystemExit here (in the main thread), so ``finally`` blocks clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None, cap: str | None = None,
        directory: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    cfg = dict(LADDERS["smoke" if size == "smoke" else "full"])
    if cap is not None:
        cfg["cap"] = parse_bytes(cap)
    version, why = cgroup.version()
    if version is None:
        print(f"capacity: skipped -- {why}.", file=sys.stderr)
        return report("capacity", [Row("capacity_vs_pytorch", 0.0, f"skipped: {why}", ">= 30", False)], json_path)
    base = directory or tempfile.gettempdir()
    check_dir(base)
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="cfx-capacity-", dir=base)
    limit = cgroup.MemoryCap(cfg["cap"])
    runs: list[dict] = []
    with _terminated_as_exit():  # a SIGTERM still removes the cgroup and the state's files
        try:
            bw = disk_bandwidth(work, cfg["probe"])
            print(f"{work}: {filesystem_of(work)}, write {bw['write'] / GiB:.2f} GiB/s, read {bw['read'] / GiB:.2f} GiB/s"
                  f"{' (O_DIRECT)' if bw['direct'] else ''}; cap {cfg['cap'] / GiB:.2f} GiB", file=sys.stderr)
            torch_best = climb(limit, "pytorch", cfg, work, runs)
            memory_best = climb(limit, "cfx", cfg, work, runs)
            nvme_best = descend(limit, "nvme", cfg, work, runs)
            uncapped = run_one(None, "cfx", cfg["same"], cfg, work, digest=True)
            capped = next((r for r in runs if r["kind"] == "nvme" and "digest" in r), None) or \
                run_one(limit, "nvme", cfg["same"], cfg, work, digest=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def count(r):
        return r["params"] if r else 0
    base_n = count(torch_best)
    trained = [r for r in runs + [capped] if r["trained"]]  # (capped may be one of runs: max is max)
    worst = max((r["anon_peak"] for r in trained), default=0) / cfg["cap"]
    same = (capped["trained"] and uncapped["trained"] and capped.get("digest") == uncapped.get("digest")
            and capped.get("losses") == uncapped.get("losses"))
    rows = [
        Row("disk_write_bandwidth", bw["write"] / GiB, "GiB/s", "printed"),
        Row("disk_read_bandwidth", bw["read"] / GiB, "GiB/s", "printed"),
        Row("largest_pytorch", base_n / 1e6, "M params", "printed"),
        Row("largest_cfx_in_memory", count(memory_best) / 1e6, "M params", "printed"),
        Row("largest_cfx_nvme", count(nvme_best) / 1e6, "M params", "printed"),
        Row("capacity_vs_pytorch", count(nvme_best) / base_n if base_n else 0.0, "x", ">= 30",
            bool(base_n) and count(nvme_best) / base_n >= 30),
        Row("capacity_in_memory_vs_pytorch", count(memory_best) / base_n if base_n else 0.0, "x", "printed"),
        Row("anon_peak_vs_cap", worst, "x (max over every run that trained)", "<= 1.0", 0 < worst <= 1.0),
        Row("capped_equals_uncapped", float(same), "bool (params and losses, bit for bit)", "true", same),
    ]
    if nvme_best:
        rows += io_rows(nvme_best, bw)
        losses = nvme_best["losses"]
        rows.append(Row("largest_loss_goes_down", float(losses[-1] < losses[0]), f"bool ({losses[0]:.3f} -> "
                        f"{losses[-1]:.3f})", "true", losses[-1] < losses[0]))
    return report("capacity", rows, json_path)
