"""Asynchronous saves: the state is copied to host memory while the caller waits, and written by a
background thread while training goes on.

``host_copies(tensors)`` is the only part the step loop waits for: each tensor copied into memory
of its own (pinned on CUDA, the copies enqueued on the current stream and waited for by the
writer, not the caller), so a step that donates or updates the state in place cannot change what
is being written. ``start(write)`` runs ``write()`` on a thread and returns a ``PendingSave``;
at most one save is in flight per process: ``start`` first waits for the previous one (and raises
its error, if it failed). ``wait()`` waits for the one in flight -- call it before reading a
checkpoint back or exiting. A write that fails raises from ``PendingSave.wait()`` / ``wait()`` /
the next ``start``: never silently lost.

What makes the write safe to interrupt is the format's, not this module's: a sharded save commits
by renaming its index into place after every process wrote (``sharded``), a file save by renaming
the file; a process killed in the middle leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch


class PendingSave:
    """A save being written in the background (``start``)."""

    def __init__(self, write: Callable[[], None], what: str):
        self.what, self.error, self.seconds = what, None, None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"cfx-save {what}", daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by wait()
            self.error = e
        self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Return once the save is written (committed); raise its error if it failed."""
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"cfx.checkpoint: the background save {self.what} failed: {error}") from error


_inflight: PendingSave | None = None
_lock = threading.Lock()


def start(write: Callable[[], None], what: str) -> PendingSave:
    """``write()`` on a background thread, after the save in flight (if any) has finished."""
    global _inflight
    wait()
    with _lock:
        _inflight = PendingSave(write, what)
        return _inflight


def wait() -> None:
    """Wait for this process's save in flight, if any (raising its error if it failed)."""
    global _inflight
    with _lock:
        pending, _inflight = _inflight, None
    if pending is not None:
        pending.wait()


def host_copies(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """``(copies, ready)``: each tensor copied into CPU memory of its own (pinned for CUDA tensors,
    copied without blocking the caller), and ``ready()``, which the writer calls before reading
    them (it waits for the device copies)."""
    out, events = {}, []
    for key, x in tensors.items():
        x = x.detach()
        if x.is_cuda:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            events.append(torch.cuda.Event())
            events[-1].record()
        else:
            host = x.clone(memory_format=torch.contiguous_format)
        out[key] = host

    def ready() -> None:
        for e in events:
            e.synchronize()
    return out, ready
