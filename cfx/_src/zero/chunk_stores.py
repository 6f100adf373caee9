"""Where a ``GeminiEngine``'s chunks live: params, fp32 masters, optimizer state and gradients,
each kind in the tier store of its ``Offload`` home (``gemini.store``: device, host, NVMe), keyed
by kind, chunk and *slice*, with the bytes moved between tiers counted (``traffic``, by ``"src->dst"``).

A chunk is stored as ``n_slices`` slices of ``slice`` elements (the last one shorter): one slice
(the whole chunk) in memory tiers; in files, slices of at most ``slice_bytes`` of fp32, so that the
optimizer step streams a chunk a slice at a time and never holds a whole chunk's params, gradient
and moments at once. Each slice has its own optimizer state (``tx.init`` of that slice): with an
elementwise optimizer, stepping slices one by one is stepping the chunk.

Every file operation runs on one I/O thread per engine (``IoThread``), in the order submitted: a
read submitted after a write of the same slice sees what was written; reads submitted ahead
(``read_async``) overlap the caller's compute. Files are read into reused page-aligned buffers
(``ReadBuffers``: no fresh pages faulted in while a read runs, ``O_DIRECT`` straight into them), and
a gradient file, once stepped, is kept to be overwritten in place by the next step's. Checksums are
taken by the thread that submits a write and checked by the thread that waits for a read (``value``,
``chunk_value``), so the I/O thread only moves bytes.
"""
from __future__ import annotations

import collections
import contextvars
import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.read_buffers import ReadBuffers
from cfx._src.gemini.store import checksum, make_stores
from cfx._src.zero.offload import Offload

SLICE_BYTES = 32 << 20  # files: at most this many bytes of fp32 per slice


class IoThread:
    """One background thread running file operations in submission order (module doc). Writes hold
    their tensors until done: once more than ``max_pending`` bytes of them wait, ``submit`` waits
    for the oldest operations first, so a producer faster than the disk cannot fill memory."""

    def __init__(self, max_pending: int = 4 * SLICE_BYTES):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cfx-nvme-io")
        self._pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.max_pending, self._bytes = max_pending, 0

    def submit(self, fn: Callable, *args: Any, nbytes: int = 0) -> Future:
        ctx = contextvars.copy_context()  # memory bookings go to the caller's tracker
        fut = self._pool.submit(ctx.run, fn, *args)
        self._pending.append((fut, nbytes))
        self._bytes += nbytes
        while self._pending and (self._pending[0][0].done() or self._bytes > self.max_pending):
            self._pop()  # a failed write raises here, at the next submission
        return fut

    def _pop(self) -> None:
        fut, nbytes = self._pending.popleft()
        self._bytes -= nbytes
        fut.result()

    def drain(self) -> None:
        """Wait for every submitted operation; raise the first one's error."""
        while self._pending:
            self._pop()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class _Unverified(NamedTuple):
    """A file read's tensor and, for each file it came from, ``(key, the part read, the checksum it must have)``."""
    tensor: torch.Tensor
    checks: list


class ChunkStores:
    """One engine's tier stores (``stores``: ``{"device": ..., "host": ..., "nvme": ...}``) for
    chunks of ``size`` elements (module doc)."""

    def __init__(self, offload: Offload, *, nvme_dir: str | None, size: int, slice_bytes: int = SLICE_BYTES):
        self.cfg = offload
        self.stores = make_stores(nvme_dir=nvme_dir, overwrite=True)  # the engine's own scratch files
        self.traffic: collections.Counter = collections.Counter()  # bytes by "src->dst"
        self.size = size
        files = nvme_dir is not None
        self.slice = max(1, min(size, slice_bytes // 4)) if files else size
        self.n_slices = math.ceil(size / self.slice)
        self.io = IoThread(max_pending=2 * self.slice * 4) if files else None  # two slices' writes in flight
        # what files are read into (and gradients summed in): reused, so the kernel faults no fresh
        # pages in while a read runs; one chunk's bytes may wait idle between uses
        self.buffers = ReadBuffers(max_idle=4 * size) if files else None
        self._inner_def = None  # the optimizer state's structure (the same for every slice)
        self._files: dict[tuple, torch.dtype] = {}  # what has been submitted to the files: key -> dtype

    def bounds(self, s: int) -> tuple[int, int]:
        return s * self.slice, min(self.size, (s + 1) * self.slice)

    # -- one slice ------------------------------------------------------------------------------------
    def put(self, tier: str, key: tuple, x: torch.Tensor, kind: str) -> None:
        """``x`` stored under ``key`` (a file: written on the I/O thread)."""
        if tier == "nvme":
            self.traffic["host->nvme"] += x.numel() * x.element_size()
            self._files[key] = x.dtype
            # the checksum taken here, so that the I/O thread only moves bytes
            crc = checksum(x) if x.device.type == "cpu" and x.is_contiguous() else None
            self.io.submit(functools.partial(self.stores["nvme"].put, key, x, kind=kind, crc=crc),
                           nbytes=x.numel() * x.element_size())
        else:
            self.stores[tier].put(key, x, kind=kind)

    def read_async(self, tier: str, key: tuple) -> Future | torch.Tensor:
        """``key``'s tensor: a Future of it for a file (read on the I/O thread), else the stored tensor."""
        if tier != "nvme":
            return self.stores[tier].get(key)
        return self.io.submit(self._read, key)

    def _read(self, key: tuple) -> _Unverified:
        shape, dtype = self.stores["nvme"].spec(key)
        x, crc = self.stores["nvme"].read(key, out=self.buffers.empty(math.prod(shape), dtype).reshape(shape))
        return _Unverified(x, [(key, x, crc)])

    def get(self, tier: str, key: tuple) -> torch.Tensor:
        return self.value(self.read_async(tier, key))

    def write(self, tier: str, key: tuple, x: torch.Tensor, kind: str) -> None:
        """``x`` as the new value of ``key``: copied into the tensor there (a file: written anew)."""
        if tier == "nvme":
            self.put(tier, key, x, kind)
        else:
            self.stores[tier].get(key).copy_(x)

    # -- whole chunks -----------------------------------------------------------------------------------
    def put_chunk(self, tier: str, kind: str, c: int, x: torch.Tensor) -> None:
        for s in range(self.n_slices):
            a, b = self.bounds(s)
            self.put(tier, (kind, c, s), x[a:b], kind)

    def chunk_async(self, tier: str, kind: str, c: int) -> Future | torch.Tensor:
        """Chunk ``c`` of ``kind`` whole: a Future of a new tensor read slice by slice from files,
        or the stored tensor of a memory tier (one slice)."""
        if tier != "nvme":
            return self.stores[tier].get((kind, c, 0))
        store, dtype = self.stores["nvme"], self._files[(kind, c, 0)]

        def read() -> _Unverified:
            out, checks = self.buffers.empty(self.size, dtype), []
            for s in range(self.n_slices):
                a, b = self.bounds(s)
                checks.append(((kind, c, s), *store.read((kind, c, s), out=out[a:b])))
            return _Unverified(out, checks)
        self.traffic["nvme->host"] += self.size * dtype.itemsize
        return self.io.submit(read)

    def value(self, x: Future | torch.Tensor) -> torch.Tensor:
        """What ``read_async`` returned, as a tensor (a file's read waited for, checked and counted)."""
        if isinstance(x, Future):
            x = self._verified(x)
            self.traffic["nvme->host"] += x.numel() * x.element_size()
        return x

    def chunk_value(self, x: Future | torch.Tensor) -> torch.Tensor:
        """What ``chunk_async`` returned, as a tensor (a file's read waited for and checked)."""
        return self._verified(x) if isinstance(x, Future) else x

    def _verified(self, fut: Future) -> torch.Tensor:
        """A read's result, its checksums computed on this (the waiting) thread, not the I/O thread."""
        got = fut.result()
        for key, x, crc in got.checks:
            self.stores["nvme"].verify(key, x, crc)
        return got.tensor

    def get_chunk(self, tier: str, kind: str, c: int) -> torch.Tensor:
        return self.chunk_value(self.chunk_async(tier, kind, c))

    # -- optimizer state: one stored tensor per leaf and slice ------------------------------------------
    def put_inner(self, c: int, s: int, inner: Any) -> None:
        leaves, self._inner_def = tree_util.flatten(inner)
        for j, x in enumerate(leaves):
            self.put(self.cfg.optim_home, ("optim", c, s, j), x, "optim")

    def inner_async(self, c: int, s: int) -> list:
        return [self.read_async(self.cfg.optim_home, ("optim", c, s, j)) for j in range(self._inner_def.num_leaves)]

    def inner_of(self, got: list) -> Any:
        return tree_util.unflatten(self._inner_def, [self.value(x) for x in got])

    def load_inner(self, c: int, s: int = 0) -> Any:
        return self.inner_of(self.inner_async(c, s))

    def write_inner(self, c: int, s: int, inner: Any) -> None:
        for j, x in enumerate(tree_util.leaves(inner)):
            self.write(self.cfg.optim_home, ("optim", c, s, j), x, "optim")

    # -- gradients: accumulated in memory, a complete chunk's written to its files -----------------------
    def grad_chunk(self, c: int, arriving: torch.Tensor) -> torch.Tensor:
        """Chunk ``c``'s gradient in memory (zeros at first), into which ``arriving`` is about to be
        added (its bytes counted as moved there)."""
        home, key = self.grad_memory, ("grad", c)
        if home == "host":
            self.traffic["device->host"] += arriving.numel() * arriving.element_size()
        if key not in self.stores[home]:
            if home == "host" and self.buffers is not None:  # a reused buffer, zeroed (touched already)
                self.stores[home].adopt(key, self.buffers.empty(self.size, arriving.dtype).zero_(), kind="grad")
            else:  # made in the store (no zeros copied into it)
                self.stores[home].empty(key, (self.size,), arriving.dtype, kind="grad").zero_()
        return self.stores[home].get(key)

    @property
    def grad_memory(self) -> str:
        return "device" if self.cfg.grad_home == "device" else "host"

    def in_memory_grads(self) -> list[int]:
        return sorted(k[1] for k in self.stores[self.grad_memory].keys() if k[0] == "grad")

    def flush_grad(self, c: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Files only: chunk ``c``'s gradient in memory added to what its files hold (micro-batches)
        and written there, slice by slice; ``[(sum of squares, non-finite count)]`` per slice, in fp32."""
        store = self.stores[self.grad_memory]
        g = store.get(("grad", c))
        store.delete(("grad", c))
        norms = []
        for s in range(self.n_slices):
            a, b = self.bounds(s)
            part = g[a:b].to(torch.float32)
            if ("grad", c, s) in self._files:
                part = self.get("nvme", ("grad", c, s)) + part
            norms.append((part.pow(2).sum(), (~torch.isfinite(part)).sum().to(torch.float32)))
            self.put("nvme", ("grad", c, s), part, "grad")
        return norms

    def has_file(self, key: tuple) -> bool:
        return key in self._files

    def discard_file(self, key: tuple) -> None:
        """Forget what ``key``'s file holds; the file stays, to be overwritten in place by the next ``put``."""
        del self._files[key]

    def take_grad(self, c: int) -> torch.Tensor:
        """Memory tiers: chunk ``c``'s gradient in fp32 (zeros where none arrived), dropped from its store."""
        key, store = ("grad", c), self.stores[self.grad_memory]
        if key not in store:
            return torch.zeros(self.size, dtype=torch.float32)
        g = store.get(key).to(torch.float32)
        store.delete(key)
        return g

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
        for store in self.stores.values():
            store.close()
