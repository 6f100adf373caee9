"""``cfx.memory``: account bytes per rank, tier and kind while a tracker is active.

Model. Memory lives in three *tiers*: ``"device"`` (accelerator memory; on a CPU-only machine an
accounting tier that code placing a tensor "on the device" reports into), ``"host"`` (CPU RAM)
and ``"nvme"`` (files). Library code reports what it holds through three module functions:

- ``record_alloc(nbytes, tier=..., kind=...) -> token`` and ``record_free(token)`` for buffers
  whose lifetime the caller manages (chunk stores, gathered payloads);
- ``watch(tensor, tier=..., kind=...)`` for tensors whose lifetime the garbage collector
  manages: the bytes of the tensor's storage count until that storage is freed.

Every report goes to every tracker active in the reporting code's ``contextvars`` context (a
``with cfx.memory.track() as mem:`` block; ``Mesh.run`` hands the caller's context to its rank
threads, so trackers opened around a mesh see every rank). With no tracker active a report costs
one ``ContextVar.get``. Bytes are booked under the rank of the reporting code (0 outside a mesh)
and released under the same rank, whichever thread frees them.

``watch`` keys on the storage, not the tensor: views and repeated watches of one storage count
once. It puts a ``weakref.finalize`` on the tensor's ``untyped_storage()``; torch keeps one Python
object per live storage, so the finalizer runs when the last tensor (or autograd's saved copy)
of that storage dies. It counts the storage's size at watch time (a later ``resize_`` is not
seen; code that frees payloads by resizing reports with ``record_alloc``/``record_free``).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cfx._src.core import context
from cfx._src.mesh.context import current_or_none
from cfx._src.core.text import format_table

TIERS = ("device", "host", "nvme")
_trackers = context.Collectors("cfx_memory_trackers")
_ops_unwatched: context.Var[bool] = context.Var("cfx_memory_ops_unwatched", False)


@contextlib.contextmanager
def ops_unwatched():
    """Inside, ``track_ops`` does not watch op outputs: for code that books its buffers itself
    (``record_alloc`` in tier stores, ``watch`` under a kind), so they are not counted twice."""
    token = _ops_unwatched.set(True)
    try:
        yield
    finally:
        _ops_unwatched.reset(token)


def is_tracking() -> bool:
    """True while a ``cfx.memory.track()`` tracker is active here (a cheap ContextVar read)."""
    return bool(_trackers.active())


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown memory tier {tier!r}; use one of {TIERS}.")


def _rank() -> int:
    ctx = current_or_none()
    return 0 if ctx is None else ctx.rank


class Token:
    """One reported allocation, as booked in each tracker that was active when it was made."""

    __slots__ = ("nbytes", "_entries", "_freed")

    def __init__(self, nbytes: int, entries: list):
        self.nbytes, self._entries, self._freed = nbytes, entries, False


def record_alloc(nbytes: int, *, tier: str, kind: str, key: Any = None) -> Token | None:
    """Report ``nbytes`` held on ``tier``; returns the token to pass to ``record_free``.

    Returns None (and records nothing) when no tracker is active; ``record_free(None)`` is fine.
    """
    _check_tier(tier)
    if nbytes < 0:
        raise ValueError(f"record_alloc: nbytes must be >= 0, got {nbytes}.")
    trackers = _trackers.active()
    if not trackers:
        return None
    rank = _rank()
    return Token(nbytes, [(t, t._alloc(rank, tier, kind, key, int(nbytes))) for t in trackers])


def record_free(token: Token | None) -> None:
    """Release an allocation reported by ``record_alloc`` (a second call is a no-op)."""
    if token is None or token._freed:
        return
    token._freed = True
    for tracker, aid in token._entries:
        tracker._free(aid)


def watch(tensor: torch.Tensor, *, tier: str, kind: str) -> None:
    """Count ``tensor``'s storage bytes on ``tier`` until the storage is garbage-collected."""
    _check_tier(tier)
    trackers = _trackers.active()
    if trackers:
        _watch_into(trackers, _rank(), tensor, tier, kind)


def _watch_into(trackers, rank, tensor, tier, kind) -> None:
    storage = _storage(tensor)  # None for sparse / nested / wrapper subclasses / meta tensors
    for t in trackers if storage is not None else ():
        t._watch(storage, rank, tier, kind)


def _storage_freed(tracker_ref, aid) -> None:
    tracker = tracker_ref()
    if tracker is not None:
        tracker._free(aid)


class MemoryTracker(context.Collector):
    """Live and peak bytes per (rank, tier, kind), with a per-(rank, tier) timeline.

    Thread-safe. Frees reported while another thread (or a garbage-collection pass inside this
    tracker's own bookkeeping) holds the lock are queued and applied before the next operation,
    so queries are always exact. ``with tracker:`` makes it active (``track`` below).
    """

    stack = _trackers

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._allocs: dict[int, tuple] = {}          # aid -> (rank, tier, kind, key, nbytes, cdata)
        self._watched: dict[int, int] = {}           # storage _cdata -> aid
        self._live: collections.Counter = collections.Counter()       # (rank, tier) -> bytes
        self._live_kind: collections.Counter = collections.Counter()  # (rank, tier, kind) -> bytes
        self._peak: collections.Counter = collections.Counter()
        self._peak_kind: collections.Counter = collections.Counter()
        self._timeline: dict[tuple, list] = collections.defaultdict(list)
        self._events = 0
        self.ops_in_ranks = False  # track(ops=True): Mesh.run books each rank's op outputs

    def track_ops(self, tier: str = "device", kind: str = "activation") -> "OpWatcher":
        """A dispatch mode that ``watch``es the fresh outputs of every op run inside it.

        Covers backward ops too: the mode is thread-local state that the autograd engine carries
        into backward, and reports go to the trackers (and the rank) current where ``track_ops``
        was called, so backward run on an engine thread is booked the same way. Outputs sharing
        storage with an input (views, in-place and ``out=`` ops) are not new memory and are
        skipped. The active trackers must include this one.
        """
        _check_tier(tier)
        trackers = _trackers.active()
        if self not in trackers:
            raise ValueError("track_ops() needs its tracker active here: call it inside "
                             "`with cfx.memory.track() as mem:`.")
        return OpWatcher(trackers, _rank(), tier=tier, kind=kind)

    # -- recording (called by the module functions) ---------------------------------------------
    def _alloc(self, rank, tier, kind, key, nbytes) -> int:
        aid = next(self._ids)
        with self._lock:
            self._drain()
            self._allocs[aid] = (rank, tier, kind, key, nbytes, None)
            self._apply(rank, tier, kind, nbytes)
        return aid

    def _watch(self, storage, rank, tier, kind) -> None:
        cdata = storage._cdata
        with self._lock:
            self._drain()
            if cdata in self._watched:
                return
            aid, nbytes = next(self._ids), storage.nbytes()
            self._watched[cdata] = aid
            self._allocs[aid] = (rank, tier, kind, None, nbytes, cdata)
            self._apply(rank, tier, kind, nbytes)
        weakref.finalize(storage, _storage_freed, weakref.ref(self), aid).atexit = False

    def _free(self, aid) -> None:
        self._pending.append(aid)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            aid = self._pending.popleft()
            entry = self._allocs.pop(aid, None)
            assert entry is not None, f"memory tracker: allocation {aid} freed twice"
            rank, tier, kind, _, nbytes, cdata = entry
            if cdata is not None:
                del self._watched[cdata]
            self._apply(rank, tier, kind, -nbytes)

    def _apply(self, rank, tier, kind, delta) -> None:
        k, kk = (rank, tier), (rank, tier, kind)
        self._live[k] += delta
        self._live_kind[kk] += delta
        assert self._live[k] >= 0 and self._live_kind[kk] >= 0, "memory tracker: negative live bytes"
        self._peak[k] = max(self._peak[k], self._live[k])
        self._peak_kind[kk] = max(self._peak_kind[kk], self._live_kind[kk])
        self._timeline[k].append((self._events, self._live[k]))
        self._events += 1

    # -- queries --------------------------------------------------------------------------------
    def _sync(self):
        with self._lock:
            self._drain()

    def ranks(self) -> list[int]:
        self._sync()
        return sorted({r for r, _ in self._timeline})

    def live(self, tier: str, *, rank: int | None = None, kind: str | None = None) -> int:
        """Bytes held now on ``tier``; ``rank=None`` sums over ranks, ``kind=None`` over kinds."""
        _check_tier(tier)
        self._sync()
        if kind is None:
            return sum(v for (r, t), v in self._live.items() if t == tier and rank in (None, r))
        return sum(v for (r, t, k), v in self._live_kind.items()
                   if t == tier and k == kind and rank in (None, r))

    def peak(self, tier: str, *, rank: int | None = None) -> int:
        """Highest bytes held at once on ``tier`` by ``rank`` (all kinds); ``None``: max over ranks."""
        _check_tier(tier)
        self._sync()
        return max((v for (r, t), v in self._peak.items() if t == tier and rank in (None, r)), default=0)

    def peak_by_kind(self, tier: str, *, rank: int | None = None) -> dict[str, int]:
        """Per kind, its own highest bytes on ``tier`` (``rank=None``: max over ranks)."""
        _check_tier(tier)
        self._sync()
        out: dict[str, int] = {}
        for (r, t, k), v in self._peak_kind.items():
            if t == tier and rank in (None, r):
                out[k] = max(out.get(k, 0), v)
        return out

    def timeline(self, tier: str, *, rank: int = 0) -> list[tuple[int, int]]:
        """``(event index, live bytes after it)`` per event on (rank, tier); indices count every
        event of this tracker, so timelines of tiers and ranks align when plotted together."""
        _check_tier(tier)
        self._sync()
        return list(self._timeline.get((rank, tier), ()))

    def allocations(self, tier: str, *, rank: int | None = None) -> list[tuple[str, Any, int]]:
        """Live allocations on ``tier`` as ``(kind, key, nbytes)`` (key None for watched tensors)."""
        _check_tier(tier)
        self._sync()
        return [(k, key, n) for r, t, k, key, n, _ in self._allocs.values()
                if t == tier and rank in (None, r)]

    def reset_peak(self) -> None:
        """Forget earlier peaks: every peak becomes the bytes live now."""
        with self._lock:
            self._drain()
            self._peak = collections.Counter(self._live)
            self._peak_kind = collections.Counter(self._live_kind)

    def summary(self) -> list[tuple]:
        """Rows ``(tier, rank, kind, live bytes, peak bytes)``; kind ``*`` is the rank's total."""
        self._sync()
        rows = [(t, r, k, self._live_kind[(r, t, k)], v) for (r, t, k), v in self._peak_kind.items()]
        rows += [(t, r, "*", self._live[(r, t)], v) for (r, t), v in self._peak.items()]
        return sorted(rows, key=lambda x: (TIERS.index(x[0]), x[1], x[2] == "*", x[2]))

    def table(self) -> str:
        return format_table(self.summary(), ["tier", "rank", "kind", "live bytes", "peak bytes"])


class OpWatcher(TorchDispatchMode):
    """``watch``es every fresh op output (see ``MemoryTracker.track_ops``)."""

    def __init__(self, trackers: tuple, rank: int, *, tier: str, kind: str):
        super().__init__()
        self.trackers, self.rank, self.tier, self.kind = trackers, rank, tier, kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _ops_unwatched.get():
            return out
        seen = {_cdata(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _cdata(t) not in seen:
                _watch_into(self.trackers, self.rank, t, self.tier, self.kind)
        return out


def _storage(t: torch.Tensor):
    try:
        return None if t.device.type == "meta" else t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _cdata(t: torch.Tensor):
    s = _storage(t)
    return None if s is None else s._cdata


def track(*, ops: bool = False) -> MemoryTracker:
    """A tracker; use as ``with cfx.memory.track() as mem:`` and query it during or after.
    ``ops=True``: inside each rank of a mesh run in the block (``Mesh.run``), every op output is
    booked too, as ``track_ops()`` does (device activations, backward included)."""
    tracker = MemoryTracker()
    tracker.ops_in_ranks = bool(ops)
    return tracker


def rank_ops() -> contextlib.ExitStack:
    """``track_ops()`` of every active tracker made with ``track(ops=True)`` (``Mesh.run`` enters
    it in each rank, after installing the rank's context)."""
    stack = contextlib.ExitStack()
    for tracker in _trackers.active():
        if tracker.ops_in_ranks:
            stack.enter_context(tracker.track_ops())
    return stack
