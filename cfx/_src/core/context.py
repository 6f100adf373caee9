"""The context cfx code reads implicitly (the rank a shard_map body runs as, an optimizer's
sharding, the collectors of statistics), as context variables that know about ``torch.compile``.

dynamo cannot trace ``ContextVar.get``. While it traces, ``Var.get`` returns the default: a
collector (``comm_stats``, ``activation_stats``, ``memory.track``, eager donation) sees nothing of
a compiled region, and a variable that changes what the code computes is ``semantic``: ``cfx.jit``
refuses to trace while one is set (``semantic_set``), rather than bake a value into a graph that
another context would reuse. The one exception is ``traced_as_constant`` (the rank a shard_map
body runs as): tracing reads the thread's real value into the graph as a constant, and
``cfx.jit`` compiles a graph per value (``compile_key``).

A value set *inside* the traced code (``cfx.zero``'s update entering ``cfx.optim.sharded``) is
seen by the reads after it in the same trace: while tracing, ``set`` / ``reset`` write a plain
attribute, which dynamo follows as a side effect of the trace (and restores when the graph has
run, so outside a trace it always holds nothing).

Whether dynamo is tracing is ``torch.compiler.is_dynamo_compiling()``, which is per call site;
``torch.compiler.is_compiling()`` is a process-wide flag, true in every thread while any thread
compiles, so it would hide a rank thread's context from that rank's eager code.
"""
from __future__ import annotations

import contextvars
import sys
import threading
from typing import Any, Callable, Generic, TypeVar

import torch

T = TypeVar("T")
_SEMANTIC: list["Var"] = []
_NOTHING = object()  # Var.traced outside an in-trace set
_BY_NAME: dict[str, "Var"] = {}
_CONSTANT: list[Callable] = []  # the functions dynamo runs for real and bakes in (see constant_result)


def constant_result(fn: Callable) -> Callable:
    """``torch._dynamo.assume_constant_result`` without importing dynamo (a second of ``import cfx``):
    the mark is put on now if dynamo is loaded, else by ``mark_constants``, which ``cfx.jit`` calls
    before it compiles anything."""
    _CONSTANT.append(fn)
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].assume_constant_result(fn)
    return fn


def mark_constants() -> None:
    """Mark the ``constant_result`` functions for dynamo (idempotent; imports dynamo)."""
    import torch._dynamo
    for fn in _CONSTANT:
        torch._dynamo.assume_constant_result(fn)


class Var(Generic[T]):
    """A ``contextvars.ContextVar`` whose reads give its default while torch.compile traces."""

    def __init__(self, name: str, default: T, *, semantic: str | None = None, traced_as_constant: bool = False):
        self.var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)
        self.default, self.semantic, self.traced_as_constant = default, semantic, traced_as_constant
        self.traced: Any = _NOTHING  # a value set inside the code dynamo is tracing (module doc)
        _BY_NAME[name] = self
        if semantic:
            _SEMANTIC.append(self)

    def get(self) -> T:
        if torch.compiler.is_dynamo_compiling():
            if self.traced is not _NOTHING:
                return self.traced
            return _read_while_tracing(self) if self.traced_as_constant else self.default
        return self.var.get()

    def set(self, value: T) -> Any:
        if torch.compiler.is_dynamo_compiling():
            token = (_TRACED, self.traced)
            self.traced = value
            return token
        return self.var.set(value)

    def reset(self, token: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            self.traced = token[1]
            return
        self.var.reset(token)


_TRACED = "cfx-traced-token"


@constant_result
def _read_while_tracing(v: Var) -> Any:
    value = v.var.get()  # run for real by dynamo, in the tracing thread
    _note(("context", v.var.name, id(value)))
    return value


# What the code dynamo traced in this thread baked into its graph of its context: the rank
# context itself (``("context", name, id)``), a rank's index along some axes (``("axis index",
# names, index)``). A rank whose own values of these are the same can run that graph (cfx.jit).
_reads = threading.local()


def _note(what: tuple) -> None:
    _reads.seen = getattr(_reads, "seen", frozenset()) | {what}


@constant_result
def note_axis_index(names: tuple, index: int) -> bool:
    """Record (at trace time, for real) that the traced code computed with this rank's ``index``
    along ``names``."""
    _note(("axis index", names, index))
    return True


def reads_reset() -> None:
    _reads.seen = frozenset()


def reads() -> frozenset:
    """What the trace in this thread baked in since ``reads_reset``."""
    return getattr(_reads, "seen", frozenset())


def reads_here(seen: frozenset, index_here: Callable[[tuple], int]) -> frozenset:
    """``seen`` (another thread's ``reads``) with this thread's own values: equal when a graph
    traced there computes here what it would compute had it been traced here."""
    out = set()
    for what in seen:
        if what[0] == "axis index":
            out.add(("axis index", what[1], index_here(what[1])))
        else:
            out.add(("context", what[1], id(_BY_NAME[what[1]].var.get())))
    return frozenset(out)


C = TypeVar("C", bound="Collector")


class Collectors:
    """The collectors of one kind active in this context, innermost last (``comm_stats``,
    ``activation_stats``, ``memory.track``, ``pipeline.trace``): a ``Var`` holding a tuple, read
    by the code that reports into them (nothing while torch.compile traces, see the module doc)."""

    def __init__(self, name: str):
        self.var: Var[tuple] = Var(name, ())

    def active(self) -> tuple:
        return self.var.get()


class Collector:
    """A ``with``-block collector: entering pushes it on its class's ``stack`` (a ``Collectors``)
    for the block, so code reporting into that stack reaches it."""

    stack: Collectors
    _token: Any = None

    def __enter__(self: C) -> C:
        self._token = self.stack.var.set(self.stack.var.get() + (self,))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.var.reset(self._token)


def semantic_set() -> list[str]:
    """What the code here runs inside (``semantic`` descriptions of the variables not at default)."""
    return [v.semantic for v in _SEMANTIC if v.var.get() is not v.default]

