"""Checkpoint policies: small frozen callables deciding, per saved tensor, where it lives.

A policy maps a ``Saved`` description (is it a matmul output? its ``checkpoint_name``? its
size) to ``"save"`` (kept on device), ``"recompute"`` (dropped, recomputed in backward) or
``"offload"`` (copied to host, brought back before use). The remat function's own inputs are
always kept: they are what recomputation starts from.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"
DECISIONS = (SAVE, RECOMPUTE, OFFLOAD)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a policy may look at for one tensor autograd wants to save."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    is_dot: bool          # an output of a matmul (mm, bmm, addmm, linear, matmul, einsum, ...)
    name: str | None      # set with cfx.checkpoint_name(x, name)


Policy = Callable[[Saved], str]


@dataclasses.dataclass(frozen=True)
class _EverythingSaveable:
    def __call__(self, s: Saved) -> str:
        return SAVE


@dataclasses.dataclass(frozen=True)
class _NothingSaveable:
    def __call__(self, s: Saved) -> str:
        return RECOMPUTE


@dataclasses.dataclass(frozen=True)
class _DotsSaveable:
    def __call__(self, s: Saved) -> str:
        return SAVE if s.is_dot else RECOMPUTE


@dataclasses.dataclass(frozen=True)
class save_only_these_names:
    """Save tensors named by ``cfx.checkpoint_name`` with one of ``names``; recompute the rest."""

    names: frozenset

    def __init__(self, *names: str):
        object.__setattr__(self, "names", frozenset(names))

    def __call__(self, s: Saved) -> str:
        return SAVE if s.name in self.names else RECOMPUTE


@dataclasses.dataclass(frozen=True)
class save_any_names_but_these:
    """Save every named tensor except those named ``names``; recompute unnamed ones."""

    names: frozenset

    def __init__(self, *names: str):
        object.__setattr__(self, "names", frozenset(names))

    def __call__(self, s: Saved) -> str:
        return SAVE if s.name is not None and s.name not in self.names else RECOMPUTE


@dataclasses.dataclass(frozen=True)
class offload_these_names:
    """Offload tensors named ``names`` to host memory; the rest follow ``otherwise``."""

    names: frozenset
    to: str = "host"
    otherwise: str = RECOMPUTE

    def __init__(self, *names: str, to: str = "host", otherwise: str = RECOMPUTE):
        if to != "host":
            raise ValueError(f"offload_these_names: only to='host' is supported, got {to!r}.")
        if otherwise not in (SAVE, RECOMPUTE):
            raise ValueError(f"offload_these_names: otherwise must be 'save' or 'recompute', got {otherwise!r}.")
        object.__setattr__(self, "names", frozenset(names))
        object.__setattr__(self, "to", to)
        object.__setattr__(self, "otherwise", otherwise)

    def __call__(self, s: Saved) -> str:
        return OFFLOAD if s.name in self.names else self.otherwise


everything_saveable = _EverythingSaveable()
nothing_saveable = _NothingSaveable()
dots_saveable = _DotsSaveable()
