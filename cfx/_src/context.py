"""The context cfx code reads implicitly (the rank a shard_map body runs as, an optimizer's
sharding, the collectors of statistics), as context variables that know about ``torch.compile``.

dynamo cannot trace ``ContextVar.get``. While it traces, ``Var.get`` returns the default: a
collector (``comm_stats``, ``activation_stats``, ``memory.track``, eager donation) sees nothing of
a compiled region, and a variable that changes what the code computes is ``semantic``: ``cfx.jit``
refuses to trace while one is set (``semantic_set``), rather than bake a value into a graph that
another context would reuse. The one exception is ``traced_as_constant`` (the rank a shard_map
body runs as): tracing reads the thread's real value into the graph as a constant, and
``cfx.jit`` compiles a graph per value (``compile_key``).

Whether dynamo is tracing is ``torch.compiler.is_dynamo_compiling()``, which is per call site;
``torch.compiler.is_compiling()`` is a process-wide flag, true in every thread while any thread
compiles, so it would hide a rank thread's context from that rank's eager code.
"""
from __future__ import annotations

import contextvars
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
_SEMANTIC: list["Var"] = []


class Var(Generic[T]):
    """A ``contextvars.ContextVar`` whose reads give its default while torch.compile traces."""

    def __init__(self, name: str, default: T, *, semantic: str | None = None, traced_as_constant: bool = False):
        self.var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)
        self.default, self.semantic, self.traced_as_constant = default, semantic, traced_as_constant
        if semantic:
            _SEMANTIC.append(self)

    def get(self) -> T:
        if torch.compiler.is_dynamo_compiling():
            return _read_while_tracing(self) if self.traced_as_constant else self.default
        return self.var.get()

    def set(self, value: T) -> contextvars.Token:
        return self.var.set(value)

    def reset(self, token: contextvars.Token) -> None:
        self.var.reset(token)


@torch._dynamo.assume_constant_result
def _read_while_tracing(v: Var) -> Any:
    return v.var.get()  # run for real by dynamo, in the tracing thread


def semantic_set() -> list[str]:
    """What the code here runs inside (``semantic`` descriptions of the variables not at default)."""
    return [v.semantic for v in _SEMANTIC if v.var.get() is not v.default]

