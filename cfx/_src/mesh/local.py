"""The ``local`` backend: every rank is a persistent thread of this process.

Each rank owns real ``ProcessGroupGloo`` groups (made lazily, one per ordered axis tuple, on an
in-process ``HashStore``), so collectives are the same gloo calls a multi-process job makes.
A rank that raises drops its groups, which closes their sockets: peers blocked on it fail
within milliseconds ("connection closed"), drop theirs, and the failure cascades; the collective
timeout is only the last resort. After a failure the next call starts a fresh generation of
groups, so the mesh stays usable.
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from cfx._src.mesh import context as ctx_lib, ledger

# torch's flight recorder (on by default) gathers the Python traceback of every collective it
# enqueues; with every rank a thread of one process, two ranks gathering at once deadlocked on its
# lock and the GIL (seen on torch 2.13, in a clean-clone CI run). The thread backend runs without it
# unless the user set its size; it is read once, when the first process group is made.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")


class RankFailure(Exception):
    """Carries one rank's exception and formatted traceback to the controller."""

    def __init__(self, rank: int, coords: dict, exc: BaseException, text: str):
        super().__init__(rank, coords, exc, text)
        self.rank, self.coords, self.exc, self.text = rank, coords, exc, text


def _is_cascade(exc: BaseException) -> bool:
    msg = str(exc)
    return ledger.is_echo(exc) or (
        isinstance(exc, RuntimeError) and not isinstance(exc, ledger.CollectiveTimeout)
        and ("Connection closed by peer" in msg or "torn down" in msg or "Timed out" in msg
             or "Connection reset" in msg or "Wait timeout" in msg))


class LocalBackend:
    name = "local"

    def __init__(self, mesh):
        self.mesh = mesh
        self.local_ranks = list(range(mesh.size))
        self._store = dist.HashStore()
        self._ledger = ledger.Ledger(mesh)  # group rendezvous always; collective matching if asked
        self._generation = 0
        self._calls = 0
        self._closed = False
        self._lock = threading.Lock()  # one shard_map call at a time on this mesh
        self._inbox: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(mesh.size)]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._saved_threads = torch.get_num_threads()
        self._threads_per_rank = max(1, (os.cpu_count() or 1) // mesh.size)
        torch.set_num_threads(min(self._saved_threads, self._threads_per_rank))
        self._contexts = [self._new_context(r) for r in range(mesh.size)]
        self._workers = [threading.Thread(target=self._worker, args=(r,), daemon=True,
                                          name=f"cfx-rank-{r}") for r in range(mesh.size)]
        for w in self._workers:
            w.start()

    # -- groups -------------------------------------------------------------------------------
    def _new_context(self, rank: int) -> ctx_lib.RankContext:
        mesh = self.mesh
        coords = mesh.coords(rank)
        return ctx_lib.RankContext(mesh, rank, coords, lambda axes: self._make_group(rank, coords, axes))

    def _make_group(self, rank: int, coords: dict, axes: tuple[str, ...]) -> ctx_lib.Group:
        mesh = self.mesh
        members = mesh.group_members(axes, rank)
        slice_id = "-".join(str(coords[a]) for a in mesh.axis_names if a not in axes)
        prefix = f"gen{self._generation}/{'.'.join(axes)}/{slice_id}"
        index = mesh.index_in(axes, coords)
        if len(members) == 1:
            return ctx_lib.Group(axes, 1, 0, _SingletonGroup())
        # every member arrives before any connects: a member that fails first releases the others
        self._ledger.join(prefix, tuple(members), rank, axes, mesh.timeout)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), index, len(members),
                                   datetime.timedelta(seconds=mesh.timeout))
        return ctx_lib.Group(axes, len(members), index, pg, key=prefix, members=tuple(members), mesh=mesh,
                             me=rank, check=self._ledger if mesh.check_collectives else None)

    # -- execution ----------------------------------------------------------------------------
    def _worker(self, rank: int) -> None:
        torch.set_num_threads(self._threads_per_rank)
        while True:
            job = self._inbox[rank].get()
            if job is None:
                return
            call, fn = job
            ctx = self._contexts[rank]
            try:
                with ctx_lib.installed(ctx):
                    out = fn(rank)
                if self.mesh.check_collectives:
                    self._ledger.finish(rank, call)  # raises if a peer waits in a collective this rank skipped
                self._outbox.put((call, rank, True, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the controller
                text = "".join(traceback.format_exception(e))
                traceback.clear_frames(e.__traceback__)  # release tensors and process groups
                self._ledger.fail(rank, call)  # peers waiting to meet this rank at a group's first use stop
                ctx.drop_groups()  # closes sockets: peers blocked on this rank fail fast
                self._outbox.put((call, rank, False, RankFailure(rank, ctx.coords, e, text)))
                del e
            job = fn = out = None  # the worker keeps nothing of a finished call: it is the caller's

    def run(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        if self._closed:
            raise ValueError(f"{self.mesh!r} is closed; make a new Mesh.")
        with self._lock:
            self._calls += 1
            call = self._calls
            self._ledger.begin(call)
            for q in self._inbox:
                q.put((call, fn))
            results: list[Any] = [None] * self.mesh.size
            failures: list[RankFailure] = []
            pending = self.mesh.size
            while pending:
                got, rank, ok, value = self._outbox.get()
                if got != call:  # a late result of a call the caller abandoned (e.g. Ctrl-C)
                    continue
                pending -= 1
                if ok:
                    results[rank] = value
                else:
                    failures.append(value)
            if failures:
                self._reset_groups()
                raise _root_cause(failures)
            return dict(enumerate(results))

    def _reset_groups(self) -> None:
        self._generation += 1
        for ctx in self._contexts:
            ctx.drop_groups()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._inbox:
            q.put(None)
        for w in self._workers:
            w.join(timeout=self.mesh.timeout)
        for ctx in self._contexts:
            ctx.drop_groups()
        torch.set_num_threads(self._saved_threads)


def _root_cause(failures: list[RankFailure]) -> BaseException:
    """The first failure that is not a consequence of another rank's failure, with its traceback."""
    primary = [f for f in failures if not _is_cascade(f.exc)] or failures
    f = min(primary, key=lambda f: f.rank)
    exc = f.exc
    others = sorted(x.rank for x in failures if x is not f)
    note = (f"raised on rank {f.rank} {f.coords} of the mesh" +
            (f" (ranks {others} failed as a consequence)" if others else "") +
            f"; that rank's traceback:\n{f.text}")
    try:
        exc.add_note(note)
        return exc
    except AttributeError:  # pragma: no cover - Python < 3.11
        return RuntimeError(note)


class _SingletonGroup:
    """A size-1 group: every collective is the identity, no sockets involved."""

    def __getattr__(self, name):
        raise AssertionError(f"collective {name} on a size-1 group should be short-circuited")
