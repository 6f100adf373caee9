"""A memory cap for one child process: a cgroup the bench creates, runs the child in, and removes.

cgroup v1 (``/sys/fs/cgroup/memory``): ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``
(memory plus swap) set to the cap; cgroup v2: ``memory.max`` and ``memory.swap.max`` (0). The child
joins the group before it ``exec``s (a shell writes its own pid to ``cgroup.procs``), so everything
it allocates, page cache included, is charged there. While it runs, the group's anonymous memory
(v1 ``total_rss`` of ``memory.stat``, v2 ``anon``) is sampled every few milliseconds: its peak is
what the process itself held, whatever the page cache of its files did; the kernel's own peak of
everything charged (``memory.max_usage_in_bytes`` / ``memory.peak``) is reported beside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


@dataclasses.dataclass
class Capped:
    """How a capped child ended: its exit code (negative: killed by that signal), whether the
    cgroup's OOM killer ended it, its peak anonymous memory, the group's peak of all charged
    memory (-1 where the kernel does not report it) and the wall seconds."""

    returncode: int
    oom_killed: bool
    anon_peak: int
    total_peak: int
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.oom_killed and not self.timed_out


def version() -> tuple[int | None, str]:
    """``(1 or 2, "")`` where this process can create memory cgroups, else ``(None, why not)``."""
    if os.path.isdir(V1) and os.path.exists(os.path.join(V1, "memory.limit_in_bytes")):
        return (1, "") if os.access(V1, os.W_OK) else (None, f"{V1} is not writable (run as root)")
    controllers = os.path.join(V2, "cgroup.controllers")
    if os.path.exists(controllers):
        with open(controllers) as f:
            names = f.read().split()
        if "memory" not in names:
            return None, "cgroup v2 without the memory controller"
        return (2, "") if os.access(V2, os.W_OK) else (None, f"{V2} is not writable (run as root)")
    return None, "no memory cgroup is mounted (neither v1 /sys/fs/cgroup/memory nor v2)"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _stat(path: str) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.partition(" ")
            out[k] = int(v)
    return out


class MemoryCap:
    """``MemoryCap(cap_bytes).run(argv)``: ``argv`` in a new cgroup capped at ``cap_bytes``."""

    _count = 0

    def __init__(self, cap_bytes: int, *, sample_s: float = 0.005):
        self.version, why = version()
        if self.version is None:
            raise RuntimeError(f"cannot cap memory here: {why}")
        self.cap, self.sample_s = int(cap_bytes), sample_s

    def _create(self) -> str:
        MemoryCap._count += 1
        name = f"cfx-capacity-{os.getpid()}-{MemoryCap._count}"
        if self.version == 1:
            path = os.path.join(V1, name)
            os.mkdir(path)
            _write(os.path.join(path, "memory.limit_in_bytes"), str(self.cap))
            memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # absent when the kernel does not account swap: then no swap is charged
                _write(memsw, str(self.cap))
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "memory.swappiness"), "0")
        else:
            with contextlib.suppress(OSError):
                _write(os.path.join(V2, "cgroup.subtree_control"), "+memory")
            path = os.path.join(V2, name)
            os.mkdir(path)
            _write(os.path.join(path, "memory.max"), str(self.cap))
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "memory.swap.max"), "0")
        return path

    def _anon(self, path: str) -> int:
        s = _stat(os.path.join(path, "memory.stat"))
        return s.get("total_rss", s.get("rss", 0)) if self.version == 1 else s.get("anon", 0)

    def _total_peak(self, path: str) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            with open(os.path.join(path, name)) as f:
                return int(f.read())
        except OSError:
            return -1

    def _oom_kills(self, path: str) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            return _stat(os.path.join(path, name)).get("oom_kill", 0)
        except (OSError, ValueError):
            return 0

    def run(self, argv: list[str], *, timeout: float, env: dict | None = None, stdout=None) -> Capped:
        path = self._create()
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(OSError, ValueError):
                    peak[0] = max(peak[0], self._anon(path))
                done.wait(self.sample_s)

        t0 = time.perf_counter()
        sampler = threading.Thread(target=sample, daemon=True)
        proc = None
        try:
            proc = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path, *argv],
                                    env=env, stdout=stdout, stderr=None if stdout is None else subprocess.STDOUT)
            sampler.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
            done.set()
            sampler.join()
            with contextlib.suppress(OSError, ValueError):
                peak[0] = max(peak[0], self._anon(path))
            return Capped(proc.returncode, self._oom_kills(path) > 0, peak[0], self._total_peak(path),
                          time.perf_counter() - t0, timed_out)
        finally:
            done.set()
            if proc is not None and proc.poll() is None:  # interrupted: the child goes with us
                proc.kill()
                proc.wait()
            self._remove(path)

    @staticmethod
    def _remove(path: str) -> None:
        for _ in range(100):  # the group empties a moment after its last process is reaped
            try:
                os.rmdir(path)
                return
            except OSError:
                time.sleep(0.05)
        print(f"warning: could not remove cgroup {path}", file=sys.stderr)
