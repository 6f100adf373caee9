"""Tier stores: where chunk payloads live (device memory, host memory, files on NVMe).

All three share one small interface: ``put(key, tensor, kind=...)`` stores a copy the store owns,
``get(key)`` hands it back, ``delete(key)`` drops it, ``nbytes`` is what the store holds. Device
and host stores return the stored tensor itself from ``get`` (writes into it stick); the NVMe
store returns a fresh CPU tensor read from disk, checked against the checksum taken at ``put``.

Each store reports what it holds to ``cfx.memory`` under its tier (kind ``"chunk"`` unless the
caller names another). A store belongs to one rank and is not thread-safe.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.parse
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from cfx._src.gemini.payload_io import PayloadIo
from cfx._src.mesh import memory


class ChecksumMismatch(OSError):
    """A chunk file read back from NVMe is not the bytes that were written."""


class _Store:
    tier: str

    def __init__(self):
        self._data: dict[Any, Any] = {}
        self._tokens: dict[Any, Any] = {}
        self._nbytes: dict[Any, int] = {}

    def _book(self, key, nbytes: int, kind: str) -> None:
        self._tokens[key] = memory.record_alloc(nbytes, tier=self.tier, kind=kind, key=key)
        self._nbytes[key] = nbytes

    def _unbook(self, key) -> None:
        memory.record_free(self._tokens.pop(key))
        del self._nbytes[key]

    def _missing(self, key) -> KeyError:
        return KeyError(f"{type(self).__name__} holds no entry {key!r}; "
                        f"it holds {sorted(map(str, self._data))}.")

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes.values())

    def keys(self) -> list:
        return list(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        for key in list(self._data):
            self.delete(key)

    def close(self) -> None:
        """Drop everything the store holds."""
        self.clear()


class _MemoryStore(_Store):
    def _alloc(self, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def put(self, key, tensor: torch.Tensor, *, kind: str = "chunk") -> torch.Tensor:
        """Store a contiguous copy of ``tensor`` under ``key`` (replacing any); returns the copy."""
        if key in self._data:
            self.delete(key)
        with memory.ops_unwatched():  # booked below as this store's, not as an op output
            copy = self._alloc(tensor)
        copy.copy_(tensor.detach())
        self._data[key] = copy
        self._book(key, copy.numel() * copy.element_size(), kind)
        return copy

    def adopt(self, key, tensor: torch.Tensor, *, kind: str = "chunk") -> torch.Tensor:
        """Store ``tensor`` itself under ``key`` (no copy) when it is contiguous and where this store
        keeps its payloads, else a copy (``put``); returns what is stored."""
        if not tensor.is_contiguous() or tensor.device != self.device:
            return self.put(key, tensor, kind=kind)
        if key in self._data:
            self.delete(key)
        self._data[key] = tensor
        self._book(key, tensor.numel() * tensor.element_size(), kind)
        return tensor

    def empty(self, key, shape: tuple[int, ...], dtype: torch.dtype, *, kind: str = "chunk") -> torch.Tensor:
        """A new uninitialised tensor stored under ``key`` (replacing any), to be filled in place."""
        if key in self._data:
            self.delete(key)
        with memory.ops_unwatched():
            out = self._alloc(torch.empty(shape, dtype=dtype, device="meta"))
        self._data[key] = out
        self._book(key, out.numel() * out.element_size(), kind)
        return out

    def get(self, key) -> torch.Tensor:
        if key not in self._data:
            raise self._missing(key)
        return self._data[key]

    def delete(self, key) -> None:
        if key not in self._data:
            raise self._missing(key)
        del self._data[key]
        self._unbook(key)


class DeviceStore(_MemoryStore):
    """Payloads in memory of ``device`` (on a CPU-only machine: ``"cpu"``, an emulated device)."""

    tier = "device"

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__()
        self.device = torch.device(device)

    def _alloc(self, like):
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)


class HostStore(_MemoryStore):
    """Payloads in host RAM, page-locked when ``pin_memory`` (needs an accelerator backend)."""

    tier = "host"
    device = torch.device("cpu")

    def __init__(self, *, pin_memory: bool = False):
        super().__init__()
        if pin_memory:
            try:
                torch.empty(1, pin_memory=True)
            except RuntimeError as e:
                raise ValueError(f"HostStore(pin_memory=True): this machine cannot pin memory ({e}); "
                                 "use pin_memory=False.") from None
        self.pin_memory = pin_memory

    def _alloc(self, like):
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin_memory)


class NvmeStore(_Store):
    """Payloads as raw bytes, one file per key in ``directory``, verified by CRC-32 on read.

    A write goes to a temporary file that is flushed, fsync'ed and renamed over the final name,
    so a crash leaves either the old file or the new one; a write that fails (a full disk)
    removes its temporary file. With ``overwrite=True`` (scratch state that nothing reads after a
    crash: a training engine's) an entry rewritten at its size is overwritten in place instead --
    no blocks freed and allocated again, about 1.7x the write bandwidth on a disk measured here --
    and a write that fails there leaves a file whose checksum no longer matches (``get`` raises
    ``ChecksumMismatch``). dtype, shape and checksum are kept in this object. The
    constructor proves the directory writable (creating it if needed, then writing and removing a
    probe file) before anything else happens.

    Files are written and read with ``O_DIRECT`` where the filesystem takes it, else buffered with
    their pages dropped at once (``payload_io``: either way the files cost the memory cgroup nothing
    between accesses). ``io`` counts the bytes read and written and the seconds spent (``read_s``,
    ``write_s``: the write's fsync included).

    The chunk files are the store's own: ``close()`` removes them, and so does the store's
    garbage collection or the interpreter's exit if nobody called it, together with the
    directory when the store created it and it is left empty. ``keep=True`` leaves the files
    (e.g. to inspect them after a run).
    """

    tier = "nvme"

    def __init__(self, directory: str | os.PathLike, *, keep: bool = False, overwrite: bool = False):
        super().__init__()
        self.directory = os.fspath(directory)
        self.keep, self.overwrite = keep, overwrite
        self.payload_io = PayloadIo()
        self.io = {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0}
        probe = os.path.join(self.directory, f".cfx-probe-{os.getpid()}-{threading.get_ident()}")
        try:
            created = not os.path.isdir(self.directory)
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0")
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"NvmeStore: directory {self.directory!r} is not writable ({e.strerror or e}); "
                             "pass a directory this user can create files in (e.g. on a local NVMe "
                             "drive) or fix its permissions.") from None
        self._finalizer = weakref.finalize(self, _remove_files, self._data, self._tokens,
                                           self.directory if created else None)
        if keep:
            self._finalizer.detach()

    def close(self) -> None:
        """Forget every entry and remove its file (unless ``keep``); the store is empty after."""
        if self.keep:
            for key in list(self._data):
                self._data.pop(key)
                self._unbook(key)
        else:
            self.clear()
            self._finalizer()  # the directory, if this store made it and nothing else is in it

    def _path(self, key) -> str:
        return os.path.join(self.directory, urllib.parse.quote(str(key), safe="") + ".chunk")

    def put(self, key, tensor: torch.Tensor, *, kind: str = "chunk", crc: int | None = None) -> None:
        """Write ``tensor``'s bytes to ``key``'s file (replacing any). ``crc``: their ``checksum``, where
        the caller took it already (e.g. on a thread that would otherwise wait for this one)."""
        t = tensor.detach().to("cpu").contiguous()
        raw = _bytes_of(t)
        path = self._path(key)
        in_place = self.overwrite and key in self._data and self._data[key][3] == raw.nbytes
        tmp = path if in_place else f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            t0 = time.perf_counter()
            fd = self.payload_io.open(tmp, os.O_WRONLY | (0 if in_place else os.O_CREAT | os.O_TRUNC))
            try:
                self.payload_io.write(fd, raw)
            finally:
                os.close(fd)
            if not in_place:
                os.replace(tmp, path)
            self.io["write_s"] += time.perf_counter() - t0
            self.io["write_bytes"] += raw.nbytes
        except BaseException:
            if not in_place:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            raise
        if key in self._data:
            self._unbook(key)
        self._data[key] = (path, t.dtype, tuple(t.shape), raw.nbytes, _crc(raw) if crc is None else crc)
        self._book(key, raw.nbytes, kind)

    def spec(self, key) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype ``get(key)`` returns."""
        if key not in self._data:
            raise self._missing(key)
        return self._data[key][2], self._data[key][1]

    def get(self, key, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A CPU tensor with the bytes of ``key`` (read into ``out`` when given: a contiguous CPU
        tensor of the stored dtype and element count); raises ``ChecksumMismatch`` if corrupted."""
        x, crc = self.read(key, out=out)
        self.verify(key, x, crc)
        return x

    def read(self, key, *, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """``get`` without the check: the bytes as read and the checksum they must have, for the
        caller to ``verify`` (e.g. on a thread that would otherwise wait for this one)."""
        if key not in self._data:
            raise self._missing(key)
        path, dtype, shape, nbytes, crc = self._data[key]
        if out is not None:
            if out.dtype != dtype or out.numel() * out.element_size() != nbytes or not out.is_contiguous():
                raise ValueError(f"NvmeStore.get({key!r}, out=...): out must be a contiguous {dtype} tensor of "
                                 f"{nbytes} bytes, got {out.dtype} {tuple(out.shape)}.")
        if nbytes == 0:
            return (torch.empty(shape, dtype=dtype) if out is None else out), crc
        raw = np.empty(nbytes, dtype=np.uint8) if out is None else out.reshape(-1).view(torch.uint8).numpy()
        t0 = time.perf_counter()
        fd = self.payload_io.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise ChecksumMismatch(f"NvmeStore: {path} for key {key!r} has the wrong size (expected "
                                       f"{nbytes} bytes); the file was truncated or overwritten.")
            got = self.payload_io.read(fd, raw)
        finally:
            os.close(fd)
        self.io["read_s"] += time.perf_counter() - t0
        self.io["read_bytes"] += got
        if got != nbytes:
            raise ChecksumMismatch(f"NvmeStore: {path} for key {key!r} ended after {got} of its {nbytes} bytes.")
        return (torch.from_numpy(raw).view(dtype).reshape(shape) if out is None else out), crc

    def verify(self, key, x: torch.Tensor, crc: int) -> None:
        """Raise ``ChecksumMismatch`` unless ``x`` (what ``read`` gave for ``key``) has checksum ``crc``."""
        found = _crc(_bytes_of(x))
        if found != crc:
            raise ChecksumMismatch(f"NvmeStore: {self._path(key)} for key {key!r} is corrupted (crc32 {found:#010x}, "
                                   f"written {crc:#010x}).")

    def delete(self, key) -> None:
        if key not in self._data:
            raise self._missing(key)
        path = self._data.pop(key)[0]
        os.remove(path)
        self._unbook(key)


def checksum(tensor: torch.Tensor) -> int:
    """The CRC-32 of a contiguous CPU tensor's bytes: what ``NvmeStore`` keeps for a file and checks."""
    return _crc(_bytes_of(tensor))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def _crc(raw: np.ndarray) -> int:
    return zlib.crc32(memoryview(raw))


def _remove_files(entries: dict, tokens: dict, directory: str | None) -> None:
    """The files of an NvmeStore's ``entries`` (and ``directory`` if given and left empty)."""
    for path, *_ in list(entries.values()):
        with contextlib.suppress(OSError):
            os.remove(path)
    entries.clear()
    for token in tokens.values():
        memory.record_free(token)
    if directory is not None:
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only succeeds when empty


def make_stores(device: str | torch.device = "cpu", *, pin_memory: bool = False,
                nvme_dir: str | os.PathLike | None = None, overwrite: bool = False) -> dict[str, _Store]:
    """``{"device": ..., "host": ..., "nvme": ...}`` (no ``"nvme"`` entry without ``nvme_dir``)."""
    stores: dict[str, _Store] = {"device": DeviceStore(device), "host": HostStore(pin_memory=pin_memory)}
    if nvme_dir is not None:
        stores["nvme"] = NvmeStore(nvme_dir, overwrite=overwrite)
    return stores
