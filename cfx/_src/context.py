"""The context cfx code reads implicitly (the rank a shard_map body runs as, an optimizer's
sharding, the collectors of statistics), as context variables that know about ``torch.compile``.

dynamo cannot trace ``ContextVar.get``. While it traces, ``Var.get`` returns the default: a
collector (``comm_stats``, ``activation_stats``, ``memory.track``, eager donation) sees nothing of
a compiled region, and a variable that changes what the code computes is ``semantic``: ``cfx.jit``
refuses to trace while one is set (``semantic_set``), rather than bake a value into a graph that
another context would reuse.
"""
from __future__ import annotations

import contextvars
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
_SEMANTIC: list["Var"] = []


class Var(Generic[T]):
    """A ``contextvars.ContextVar`` whose reads give its default while torch.compile traces."""

    def __init__(self, name: str, default: T, *, semantic: str | None = None):
        self.var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)
        self.default, self.semantic = default, semantic
        if semantic:
            _SEMANTIC.append(self)

    def get(self) -> T:
        return self.default if torch.compiler.is_compiling() else self.var.get()

    def set(self, value: T) -> contextvars.Token:
        return self.var.set(value)

    def reset(self, token: contextvars.Token) -> None:
        self.var.reset(token)


def semantic_set() -> list[str]:
    """What the code here runs inside (``semantic`` descriptions of the variables not at default)."""
    return [v.semantic for v in _SEMANTIC if v.var.get() is not v.default]

