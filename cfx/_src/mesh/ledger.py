"""Collective matching: what every rank of a group is about to run, compared before bytes move.

Each rank numbers the collectives it issues on a group (``seq``) and describes each one as a
``Call``: the op, the axes as requested, the shapes and the dtype. Before the backend sees a
collective, the rank *posts* its call:

- ``Ledger`` (the ``local`` backend, on by default): one table shared by the rank threads. The
  first rank to post a (group, seq) opens a slot; each later rank compares its call with what
  is there. A rank whose call differs raises ``CollectiveMismatch`` naming both sides, without
  entering the backend (so gloo never sees two sizes for one buffer, which aborts the process);
  the ranks already waiting in the backend fail when it drops its sockets and find the same
  message in the slot. A rank whose body returns while a peer waits in a collective it never
  issued raises too (it skipped it), and so does a peer that posts after it returned. Group
  creation is a rendezvous here as well, so a rank that fails before its first collective on
  some axes releases the peers waiting to meet it at once instead of at the store's timeout.
- ``Fingerprints`` (the ``dist`` backend, ``Mesh(check_collectives=True)``): the call is coded
  into a small int64 tensor that the group all-gathers before the collective; every rank sees
  every rank's code and raises the same ``CollectiveMismatch``.

A collective that times out anyway raises ``CollectiveTimeout`` naming the rank, the axes, the
op and its sequence number, which ranks of the group reached it and where the others were.
"""
from __future__ import annotations

import threading
import time
import zlib
from typing import Any, NamedTuple

import torch

_SHOWN = {"all_reduce[sum]": "psum", "all_reduce[max]": "pmax", "all_reduce[min]": "pmin",
          "reduce_scatter": "psum_scatter"}
_OPS = ("all_reduce[sum]", "all_reduce[max]", "all_reduce[min]", "all_gather", "reduce_scatter",
        "all_to_all", "ppermute", "message", "group")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_FIX = ("Every rank of a group must issue the same collectives in the same order, with the same shapes "
        "and dtypes: look for rank-dependent control flow (branches on axis_index or on data) or per-rank "
        "shapes before it.")


class Call(NamedTuple):
    """One collective as a rank issues it."""

    op: str
    axes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    detail: str = ""

    def show(self, seq: int) -> str:
        shapes = self.shapes[0] if len(self.shapes) == 1 else list(self.shapes)
        detail = f", {self.detail}" if self.detail else ""
        return f"{_SHOWN.get(self.op, self.op)} #{seq} over {self.axes} ({self.dtype} {shapes}{detail})"


class CollectiveMismatch(ValueError):
    """Ranks of one group issued different collectives at the same position."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the mesh's timeout."""


class PeerFailed(RuntimeError):
    """This rank stopped because another rank of its group failed (a consequence, not a cause)."""


def echoed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on this rank because of what another rank did (see ``is_echo``)."""
    exc.cfx_echo = True
    return exc


def is_echo(exc: BaseException) -> bool:
    return isinstance(exc, PeerFailed) or getattr(exc, "cfx_echo", False)


def _where(mesh: Any, rank: int) -> str:
    return f"rank {rank} {mesh.coords(rank)}"


class Ledger:
    """The ``local`` backend's shared table of posted collectives (see the module doc)."""

    def __init__(self, mesh: Any):
        self.mesh = mesh
        self._cv = threading.Condition()
        self._open: dict[tuple, dict[int, Call]] = {}     # (group key, seq) -> rank -> call
        self._members: dict[Any, tuple[int, ...]] = {}    # group key -> global ranks
        self._broken: dict[tuple, str] = {}               # (group key, seq) -> mismatch message
        self._last: dict[tuple, tuple[int, Call]] = {}    # (group key, rank) -> its last post
        self._joined: dict[Any, set[int]] = {}            # group key -> ranks that reached it
        self._finished: set[int] = set()                  # ranks whose body returned this call
        self._failed: set[int] = set()                    # ranks that raised this call
        self._call = None

    def begin(self, call: int) -> None:
        """A new call of the mesh: every rank is running again."""
        with self._cv:
            self._call = call
            self._open.clear()
            self._broken.clear()
            self._finished.clear()
            self._failed.clear()

    # -- group creation ------------------------------------------------------------------------
    def join(self, key: Any, members: tuple[int, ...], rank: int, axes: tuple[str, ...],
             timeout: float) -> None:
        """Block until every member reached its first use of the group (or raise: a member failed,
        returned without it, or the timeout passed)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._members[key] = members
            joined = self._joined.setdefault(key, set())
            joined.add(rank)
            self._cv.notify_all()
            while not joined.issuperset(members):
                failed = sorted(self._failed.intersection(members))
                if failed:
                    raise PeerFailed(f"{_where(self.mesh, rank)} stopped before its first collective over "
                                     f"{axes}: rank(s) {failed} of that group failed (see their error).")
                gone = sorted(self._finished.intersection(members) - joined)
                if gone:
                    raise CollectiveMismatch(self._skipped_message(gone, axes, sorted(joined), "its first collective"))
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(members) - joined)
                    raise CollectiveTimeout(
                        f"{_where(self.mesh, rank)}: the first collective over {axes} timed out after "
                        f"{self.mesh.timeout:g} s; ranks {sorted(joined)} reached it, {missing} did not. "
                        f"{_FIX} Raise Mesh(timeout=...) if a rank legitimately computes that long.")
                self._cv.wait(min(left, 1.0))

    # -- collectives -----------------------------------------------------------------------------
    def post(self, key: Any, members: tuple[int, ...], seq: int, rank: int, call: Call) -> None:
        """Record that ``rank`` is about to run ``call`` as the ``seq``-th collective of the group;
        ``CollectiveMismatch`` if a member posted something else there or returned without it."""
        with self._cv:
            self._members[key] = members
            slot = self._open.setdefault((key, seq), {})
            for r, other in slot.items():
                if other != call:
                    (a, ca), (b, cb) = sorted([(r, other), (rank, call)], key=lambda side: side[0])
                    msg = (f"collective mismatch over mesh axes {call.axes}: {_where(self.mesh, a)} runs "
                           f"{ca.show(seq)}, {_where(self.mesh, b)} runs {cb.show(seq)}. {_FIX}")
                    self._broken[(key, seq)] = msg
                    raise CollectiveMismatch(msg)
            gone = sorted(m for m in self._finished.intersection(members) if m not in slot)
            if gone:
                msg = self._skipped_message(gone, call.axes, sorted([*slot, rank]), call.show(seq))
                self._broken[(key, seq)] = msg
                raise CollectiveMismatch(msg)
            slot[rank] = call
            self._last[(key, rank)] = (seq, call)
            if len(slot) == len(members):
                del self._open[(key, seq)]

    def finish(self, rank: int, call: int) -> None:
        """``rank``'s body returned: ``CollectiveMismatch`` if a peer waits in a collective (or a
        group's first use) that this rank never reached."""
        with self._cv:
            if call != self._call:  # a late rank of a call the caller abandoned
                return
            self._finished.add(rank)
            self._cv.notify_all()
            for (key, seq), slot in self._open.items():
                if rank in self._members[key] and rank not in slot:
                    call = next(iter(slot.values()))
                    msg = self._skipped_message([rank], call.axes, sorted(slot), call.show(seq))
                    self._broken[(key, seq)] = msg
                    raise CollectiveMismatch(msg)

    def fail(self, rank: int, call: int) -> None:
        """``rank`` raised: peers waiting to meet it at a group's first use stop now."""
        with self._cv:
            if call != self._call:
                return
            self._failed.add(rank)
            self._cv.notify_all()

    def explain(self, key: Any, seq: int, rank: int, call: Call, exc: BaseException) -> BaseException | None:
        """What to raise instead of the backend's ``exc`` for ``call``: the mismatch found at its
        slot, a named timeout, or None (a consequence of another rank's failure: keep ``exc``)."""
        with self._cv:
            msg = self._broken.get((key, seq))
            if msg is not None:
                return echoed(CollectiveMismatch(msg))
            if not timed_out(exc):
                return None
            members = self._members.get(key, ())
            slot = self._open.get((key, seq), {rank: call})
            missing = [m for m in members if m not in slot]
            seen = []
            for m in missing:
                last = self._last.get((key, m))
                seen.append(f"rank {m}: last issued {last[1].show(last[0])}" if last
                            else f"rank {m}: issued nothing over these axes")
            return timeout_error(self.mesh, rank, call, seq, reached=sorted(slot), others="; ".join(seen))

    def _skipped_message(self, gone: list[int], axes: tuple[str, ...], waiting: list[int], what: str) -> str:
        return (f"collective mismatch over mesh axes {axes}: rank(s) {gone} returned from the shard_map "
                f"body without issuing {what}, which rank(s) {waiting} wait in. {_FIX}")


def timed_out(exc: BaseException) -> bool:
    msg = str(exc)
    return "Timed out" in msg or "timed out" in msg or "Wait timeout" in msg


def timeout_error(mesh: Any, rank: int, call: Call, seq: int, *, reached: list[int] | None,
                  others: str) -> CollectiveTimeout:
    where = f"ranks {reached} of the group reached it" if reached is not None else "this rank reached it"
    return CollectiveTimeout(
        f"{_where(mesh, rank)}: {call.show(seq)} timed out after {mesh.timeout:g} s; {where}"
        f"{'; ' + others if others else ''}. A rank that skips a collective or waits in another one "
        "leaves its peers here; raise Mesh(timeout=...) if a rank legitimately computes that long.")


def who_reached(key: Any, seq: int, rank: int, members: tuple[int, ...], timeout: float) -> list[int] | None:
    """The dist backend after a timeout: the members that also timed out in this collective, found
    by each one writing a key to the job's store and waiting briefly for the others' (a member
    that never reached it writes none). None if the store cannot be reached."""
    import torch.distributed as dist
    try:
        store = dist.distributed_c10d._get_default_store()
        tag = f"cfx/timed_out/{'.'.join(key) if isinstance(key, tuple) else key}/{seq}"
        store.set(f"{tag}/{rank}", "1")
        deadline = time.monotonic() + min(2.0, timeout)
        found = {rank}
        while time.monotonic() < deadline and len(found) < len(members):
            found |= {m for m in members if m not in found and store.check([f"{tag}/{m}"])}
            time.sleep(0.05)
        return sorted(found)
    except Exception:  # noqa: BLE001 - a report, not a requirement
        return None


# -- the dist backend's fingerprint exchange ------------------------------------------------------
_MAX_DIMS = 8


def fingerprint(seq: int, call: Call) -> torch.Tensor:
    """``call`` at ``seq`` as int64s: seq, op, dtype, rank of the first shape, its first dims, and a
    checksum of everything (other shapes, axes, detail)."""
    shape = call.shapes[0] if call.shapes else ()
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    crc = zlib.crc32(repr((call.op, call.axes, call.shapes, str(call.dtype), call.detail)).encode())
    code = _DTYPES.index(call.dtype) if call.dtype in _DTYPES else len(_DTYPES)
    return torch.tensor([seq, _OPS.index(call.op), code, len(shape), *dims, crc], dtype=torch.int64)


def show_fingerprint(row: list[int], axes: tuple[str, ...]) -> str:
    seq, op, code, ndim, *rest = row
    shape = tuple(rest[:min(ndim, _MAX_DIMS)])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    return f"{_SHOWN.get(_OPS[op], _OPS[op])} #{seq} over {axes} ({dtype} {shape})"


def compare_fingerprints(mesh: Any, members: tuple[int, ...], rank: int, seq: int, call: Call,
                         rows: torch.Tensor) -> None:
    """Raise ``CollectiveMismatch`` (on every rank alike) if the gathered fingerprints differ."""
    rows = rows.tolist()
    for i, row in enumerate(rows):
        if row != rows[0]:
            a, b = members[0], members[i]
            raise CollectiveMismatch(
                f"collective mismatch over mesh axes {call.axes}: {_where(mesh, a)} runs "
                f"{show_fingerprint(rows[0], call.axes)}, {_where(mesh, b)} runs "
                f"{show_fingerprint(row, call.axes)} (seen from rank {rank}). {_FIX}")
