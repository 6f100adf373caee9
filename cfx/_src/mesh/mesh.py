"""``Mesh``: named axes over ranks, and the group layout every backend shares.

Ranks are numbered row-major over the axes in the order given: in ``Mesh({"data": 2,
"model": 2})`` rank 1 is ``data=0, model=1``. The group for an ordered tuple of axes holds the
ranks that differ only along those axes; a rank's index in it is its coordinates linearised
over the tuple, major to minor (so ``("data", "model")`` and ``("model", "data")`` are
different orders of the same members).
"""
from __future__ import annotations

import contextvars
import math
import os
from typing import Any, Callable, Mapping, Sequence

DEFAULT_TIMEOUT_S = 60.0


class Mesh:
    """Named device-mesh axes, e.g. ``Mesh({"data": 2, "model": 2})``.

    ``backend``: ``"local"`` (every rank a thread of this process, real gloo groups over an
    in-process store), ``"dist"`` (one process per rank: under torchrun or an initialised
    process group), or ``"auto"`` (``dist`` when ``torch.distributed`` is initialised or
    ``WORLD_SIZE`` is set, else ``local``). ``timeout`` (seconds, default 60) bounds every
    collective: a rank that fails makes the others fail within it, and a collective that does not
    complete raises ``CollectiveTimeout`` naming the rank, the axes, the op and its number.
    ``check_collectives``: match every collective across the ranks of its group before it runs
    (op, axes, shapes, dtype, sequence number), raising ``CollectiveMismatch`` naming both sides
    instead of hanging, mixing up values or aborting in the backend; on by default on ``local``
    (a shared table, nearly free), off on ``dist`` (where it all-gathers a small fingerprint
    before each collective). Use as a context manager, or ``close()``.
    """

    def __init__(self, axes: Mapping[str, int], *, backend: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, check_collectives: bool | None = None):
        if not isinstance(axes, Mapping) or not axes:
            raise ValueError(f"Mesh: axes must be a non-empty mapping of axis name -> size, e.g. "
                             f"Mesh({{'data': 2}}); got {axes!r}.")
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"Mesh: axis names must be identifiers, got {name!r}.")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Mesh: axis {name!r} must have a positive int size, got {size!r}.")
        if timeout <= 0:
            raise ValueError(f"Mesh: timeout must be positive seconds, got {timeout!r}.")
        self.axis_names: tuple[str, ...] = tuple(axes)
        self.shape: dict[str, int] = dict(axes)
        self.size: int = math.prod(axes.values())
        self.timeout = float(timeout)
        if backend == "auto":
            backend = "dist" if _dist_initialised_or_launched() else "local"
        self.check_collectives = bool(backend == "local" if check_collectives is None else check_collectives)
        if backend == "local":
            from cfx._src.mesh.local import LocalBackend
            self.backend = LocalBackend(self)
        elif backend == "dist":
            from cfx._src.mesh.dist import DistBackend
            self.backend = DistBackend(self)
        else:
            raise ValueError(f"Mesh: backend must be 'auto', 'local' or 'dist', got {backend!r}.")

    # -- layout -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {v}" for k, v in self.shape.items())
        return f"Mesh({{{inner}}}, backend={self.backend.name!r})"

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name in reversed(self.axis_names):
            rank, out[name] = divmod(rank, self.shape[name])
        return {name: out[name] for name in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        r = 0
        for name in self.axis_names:
            r = r * self.shape[name] + coords[name]
        return r

    def axes_size(self, axes: Sequence[str]) -> int:
        return math.prod(self.shape[a] for a in axes)

    def index_in(self, axes: Sequence[str], coords: Mapping[str, int]) -> int:
        """The rank's index along ``axes`` linearised major to minor."""
        i = 0
        for a in axes:
            i = i * self.shape[a] + coords[a]
        return i

    def group_members(self, axes: Sequence[str], rank: int) -> list[int]:
        """Global ranks of ``rank``'s group along ``axes``, ordered by their index in the group."""
        base = self.coords(rank)
        members = []
        for i in range(self.axes_size(axes)):
            c = dict(base)
            for a in reversed(axes):
                i, c[a] = divmod(i, self.shape[a])
            members.append(self.rank_of(c))
        return members

    def check_axes(self, axes: Sequence[str], where: str) -> tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in self.shape:
                raise ValueError(f"{where}: unknown mesh axis {a!r}; {self!r} has axes "
                                 f"{list(self.axis_names)}.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{where}: axis names repeat in {axes}; name each mesh axis once.")
        return axes

    # -- lifetime -----------------------------------------------------------------------------
    def run(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        """``{rank: fn(rank)}`` for every rank this process drives (all of them under ``local``,
        its own under ``dist``), each run with that rank's context installed.

        Each rank runs in a copy of the caller's ``contextvars`` context, so whatever the caller
        has active (``comm_stats``, ``activation_stats``, ``cfx.memory`` trackers) is active in
        the ranks too (with ``cfx.memory.track(ops=True)``, op outputs are booked per rank).
        """
        from cfx._src.mesh import memory
        from cfx._src.mesh import context as ctx_lib
        caller = contextvars.copy_context()

        def in_rank(rank_ctx, rank: int):
            with ctx_lib.installed(rank_ctx), memory.rank_ops():
                return fn(rank)

        def in_caller_context(rank: int):
            return caller.copy().run(in_rank, ctx_lib._current.get(), rank)
        return self.backend.run(in_caller_context)

    @property
    def local_ranks(self) -> list[int]:
        return self.backend.local_ranks

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dist_initialised_or_launched() -> bool:
    import torch.distributed as dist
    return (dist.is_available() and dist.is_initialized()) or "TORCHELASTIC_RUN_ID" in os.environ \
        or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


class AbstractMesh(Mesh):
    """A mesh's axes and sizes without ranks or process groups (JAX's ``AbstractMesh``): enough
    to lay arrays out and plan a strategy before any rank starts (``Plan.describe``)."""

    def __init__(self, axes: Mapping[str, int]):
        if not isinstance(axes, Mapping) or not axes:
            raise ValueError(f"AbstractMesh: axes must be a non-empty mapping of axis name -> size, got {axes!r}.")
        self.axis_names = tuple(axes)
        self.shape = dict(axes)
        self.size = math.prod(axes.values())
        self.backend = None

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {v}" for k, v in self.shape.items())
        return f"AbstractMesh({{{inner}}})"

    def run(self, fn):
        raise ValueError(f"{self!r} has no ranks to run on; open a cfx.Mesh with these axes.")

    def close(self) -> None:
        pass
