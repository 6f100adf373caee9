"""Per-rank execution context: which mesh, rank and process groups the running code belongs to.

A shard_map body runs with a ``RankContext`` installed for its thread (``local`` backend: the
rank's worker thread; ``dist``: the process's own thread); ``cfx.lax`` collectives look their
groups up here. Nothing here is process-wide.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from cfx._src.core import context
from cfx._src.mesh import ledger


class Group:
    """A process group for one ordered tuple of mesh axes, as seen by one rank.

    Holds the only strong reference to the torch ProcessGroup, so that dropping it on failure
    closes its sockets and fails peers blocked on this rank fast instead of at the timeout.
    Numbers the collectives this rank issues on it and has them matched across its members
    before they run (``issue``; ``cfx._src.mesh.ledger``): ``check`` is the local backend's
    ``Ledger``, ``"fingerprints"`` (the dist backend's exchange) or None.
    """

    __slots__ = ("axes", "size", "rank", "pg", "key", "members", "mesh", "me", "check", "seq", "_messages")

    def __init__(self, axes: tuple[str, ...], size: int, rank: int, pg: Any, *, key: Any = None,
                 members: tuple[int, ...] = (), mesh: Any = None, me: int = 0, check: Any = None):
        self.axes, self.size, self.rank, self.pg = axes, size, rank, pg
        self.key, self.members, self.mesh, self.me, self.check = key, tuple(members), mesh, me, check
        self.seq = 0
        self._messages: dict[tuple, int] = {}

    def get(self) -> Any:
        if self.pg is None:
            raise RuntimeError(f"the process group for mesh axes {self.axes} was torn down after a "
                               "failure on another rank; this call cannot continue.")
        return self.pg

    def issue(self, call: ledger.Call) -> int:
        """Number ``call`` (this rank's next collective on the group) and match it across members."""
        self.seq += 1
        if self.check is None:
            return self.seq
        if self.check == "fingerprints":
            self._exchange(call)
        else:
            self.check.post(self.key, self.members, self.seq, self.me, call)
        return self.seq

    def issue_message(self, call: ledger.Call, src: int, dst: int, tag: int) -> tuple[Any, int]:
        """Number a point-to-point message from group rank ``src`` to ``dst`` (both sides count
        their messages of one pair and tag alike) and match it; ``(slot key, seq)``."""
        pair = (src, dst, tag)
        seq = self._messages[pair] = self._messages.get(pair, 0) + 1
        key = (self.key, "message", *pair)
        if isinstance(self.check, ledger.Ledger):
            self.check.post(key, (self.members[src], self.members[dst]), seq, self.me, call)
        return key, seq

    def wait(self, work: Any, call: ledger.Call, seq: int, key: Any = None) -> None:
        """``work.wait()``, raising a named mismatch or timeout instead of the backend's error."""
        try:
            work.wait()
        except RuntimeError as e:
            better = self.explain(key if key is not None else self.key, seq, call, e)
            if better is None:
                raise
            raise better from None

    def explain(self, key: Any, seq: int, call: ledger.Call, exc: BaseException) -> BaseException | None:
        if isinstance(self.check, ledger.Ledger):
            return self.check.explain(key, seq, self.me, call, exc)
        if self.mesh is not None and ledger.timed_out(exc):
            reached = ledger.who_reached(self.key, seq, self.me, self.members, self.mesh.timeout)
            return ledger.timeout_error(self.mesh, self.me, call, seq, reached=reached, others="")
        return None

    def _exchange(self, call: ledger.Call) -> None:
        mine = ledger.fingerprint(self.seq, call)
        rows = mine.new_empty((self.size, mine.numel()))
        self.get().allgather([list(rows.unbind(0))], [mine]).wait()
        ledger.compare_fingerprints(self.mesh, self.members, self.me, self.seq, call, rows)


@dataclasses.dataclass
class RankContext:
    mesh: Any
    rank: int
    coords: dict[str, int]
    make_group: Callable[[tuple[str, ...]], Group]
    groups: dict[tuple[str, ...], Group] = dataclasses.field(default_factory=dict)

    def group(self, axes: tuple[str, ...]) -> Group:
        """The group over ``axes`` in the mesh's axis order (one group per member set)."""
        axes = tuple(a for a in self.mesh.axis_names if a in axes)
        g = self.groups.get(axes)
        if g is None:
            g = self.groups[axes] = self.make_group(axes)
        return g

    def drop_groups(self) -> None:
        for g in self.groups.values():
            g.pg = None
        self.groups.clear()


_current: context.Var[RankContext | None] = context.Var("cfx_rank", None, traced_as_constant=True)


def current(where: str) -> RankContext:
    ctx = _current.get()
    if ctx is None:
        raise ValueError(f"{where} names mesh axes, so it must run inside cfx.shard_map(f, mesh=...); "
                         "it was called outside any mesh.")
    return ctx


def current_or_none() -> RankContext | None:
    return _current.get()


def compile_key() -> tuple | None:
    """What a graph compiled here is specialised to: the mesh's axes and this rank (the rank's
    index along an axis is a constant of its graph); ``None`` outside shard_map bodies."""
    ctx = _current.get()
    return None if ctx is None else (tuple(ctx.mesh.shape.items()), ctx.rank)


@contextlib.contextmanager
def installed(ctx: RankContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
