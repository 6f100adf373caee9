"""How ``NvmeStore`` moves one payload's bytes to and from its file.

With ``O_DIRECT`` where the filesystem takes it: no page cache, so the files cost the process's memory
cgroup nothing, and no kernel copy (measured here under training: direct writes 1.75 GiB/s against 0.95
buffered). Memory that starts on a page (e.g. from ``ReadBuffers``) goes to and from the disk as it is;
other memory through a page-aligned staging buffer, a piece at a time; a last partial block is padded
and the file cut back to its size. Where the filesystem refuses ``O_DIRECT`` (``EINVAL`` at open), the
I/O is buffered from then on and the file's pages dropped from the cache at once (``posix_fadvise
DONTNEED`` after the fsync and after each read).
"""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np

ALIGN = 4096  # O_DIRECT: file offsets, lengths and memory on this boundary
STAGING = 8 << 20  # bytes staged at a time for memory that does not start on a page


class PayloadIo:
    """One store's file I/O (module doc); ``direct`` until the filesystem refuses it."""

    def __init__(self, staging_bytes: int = STAGING):
        self.direct = hasattr(os, "O_DIRECT")
        self.staging_bytes = staging_bytes
        self._staging: np.ndarray | None = None

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, mode)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem takes no O_DIRECT: buffered from now on
        return os.open(path, flags, mode)

    def write(self, fd: int, raw: np.ndarray) -> None:
        """``raw``'s bytes from the start of ``fd`` (opened by ``open``), on the disk when this returns."""
        if self.direct:
            _write_direct(fd, raw, self.staging())
        else:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
        drop_cached(fd)

    def read(self, fd: int, raw: np.ndarray) -> int:
        """``fd``'s bytes (opened by ``open``) into ``raw``; how many were read."""
        if self.direct:
            return _read_direct(fd, raw, self.staging())
        got = _pread_all(fd, memoryview(raw), 0)
        drop_cached(fd)
        return got

    def staging(self) -> np.ndarray:
        if self._staging is None:
            self._staging = np.frombuffer(mmap.mmap(-1, self.staging_bytes), dtype=np.uint8)
        return self._staging


def _write_direct(fd: int, raw: np.ndarray, staging: np.ndarray) -> None:
    n, off = raw.nbytes, 0
    body = n - n % ALIGN
    if body and raw.ctypes.data % ALIGN == 0:
        _pwrite_all(fd, memoryview(raw[:body]), 0)
        off = body
    while off < n:
        k = min(len(staging), n - off)
        padded = -(-k // ALIGN) * ALIGN
        staging[:k] = raw[off:off + k]
        staging[k:padded] = 0
        _pwrite_all(fd, memoryview(staging[:padded]), off)
        off += k
    if n % ALIGN:
        os.ftruncate(fd, n)


def _read_direct(fd: int, raw: np.ndarray, staging: np.ndarray) -> int:
    n, got = raw.nbytes, 0
    body = n - n % ALIGN
    if body and raw.ctypes.data % ALIGN == 0:
        got = _pread_all(fd, memoryview(raw[:body]), 0)
        if got < body:
            return got
    while got < n:
        k = min(len(staging), n - got)
        padded = -(-k // ALIGN) * ALIGN
        r = min(k, _pread_all(fd, memoryview(staging[:padded]), got))
        raw[got:got + r] = staging[:r]
        got += r
        if r < k:
            break
    return got


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        r = os.preadv(fd, [view[got:]], offset + got)
        if not r:
            break
        got += r
    return got


def drop_cached(fd: int) -> None:
    """The file's clean pages out of the page cache (where the platform has ``posix_fadvise``)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
