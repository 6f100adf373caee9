"""Reused host buffers for file reads: page-aligned, already touched, handed back by themselves.

A buffer the kernel fills for the first time is faulted in page by page while the read runs:
measured here, 4 KiB faults cost a fresh buffer about a third of a read's time at the disk's
bandwidth. A ``ReadBuffers`` pool hands out CPU tensors backed by anonymous mappings (page-aligned,
so ``O_DIRECT`` reads go straight into them) and takes a mapping back, already touched, once the
last tensor using its memory is gone: the tensor's storage holds the one NumPy array the pool made
for it, and a finalizer on that array returns the mapping, so no view of a returned buffer can
still be alive (views keep the storage, the storage keeps the array).

At most ``max_idle`` bytes wait unused: a buffer coming back pushes out the idle ones that came back
longest ago (so a phase that reads other sizes -- whole chunks, then slices of them -- takes the
budget over); ``trim()`` drops every idle one. Requests under a page are plain tensors. Finalizers
run on whichever thread drops the last reference, so the idle list is guarded by a lock.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch


class ReadBuffers:
    """Pool of page-aligned host buffers for reads (module doc)."""

    def __init__(self, max_idle: int):
        self.max_idle = max_idle
        self._idle: list[mmap.mmap] = []  # oldest returned first
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.made = self.reused = 0  # buffers mapped anew / handed out again

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``numel`` elements of ``dtype`` (contents undefined)."""
        nbytes = numel * dtype.itemsize
        if nbytes < mmap.PAGESIZE:
            return torch.empty(numel, dtype=dtype)
        buf = None
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # the most recently returned of this size
                if len(self._idle[i]) == nbytes:
                    buf = self._idle.pop(i)
                    self._idle_bytes -= nbytes
                    self.reused += 1
                    break
        if buf is None:
            buf = mmap.mmap(-1, nbytes)
            self.made += 1
        arr = np.frombuffer(buf, dtype=np.uint8)
        fin = weakref.finalize(arr, self._give_back, buf)
        fin.atexit = False
        return torch.from_numpy(arr).view(dtype)

    def _give_back(self, buf: mmap.mmap) -> None:
        if len(buf) > self.max_idle:
            return  # dropped: the mapping is unmapped once the array's export of it is released
        with self._lock:
            while self._idle_bytes + len(buf) > self.max_idle:
                self._idle_bytes -= len(self._idle.pop(0))
            self._idle.append(buf)
            self._idle_bytes += len(buf)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def trim(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            self._idle.clear()  # nothing else refers to an idle mapping: dropping it unmaps it
            self._idle_bytes = 0
