"""Specs and strategies, the vocabulary of the auto-parallel search: a tensor's *spec* is a ``P``
naming, per dimension, the mesh axes splitting it (in the mesh's order), each axis used at most
once and only where the axes divide the dimension (``specs_of``); a ``Strategy`` is one way to run
an op: its output's spec, the spec each input must arrive in, how many ways its FLOPs split, and
the partial sums its outputs are (all-reduced at the op's cost)."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

import torch

from cfx._src.mesh.spec import P


@dataclasses.dataclass(frozen=True)
class Strategy:
    out: P                          # the output's spec (the first output's, for an op returning several)
    ins: tuple[P | None, ...]       # the spec each input must arrive in (None: not a tensor)
    div: int = 1                    # the op's FLOPs are split this many ways
    partial: tuple[str, ...] = ()   # mesh axes the output is a partial sum over (all-reduced)
    outs: tuple[P, ...] = ()        # an op returning several tensors: each one's spec
    reduces: tuple[tuple[int, tuple[str, ...]], ...] = ()  # ... and (output, axes) partial sums among them
    source: int | None = None       # a getitem: the strategy of the op it reads from


def specs_of(shape: Sequence[int], mesh_shape: dict[str, int]) -> list[P]:
    """Every spec of ``shape``: each axis on at most one dimension, the axes of a dimension dividing it."""
    out = []
    for places in itertools.product(range(-1, len(shape)), repeat=len(mesh_shape)):
        dims: list[tuple[str, ...]] = [() for _ in shape]
        for a, d in zip(mesh_shape, places):
            if d >= 0:
                dims[d] += (a,)
        if all(shape[d] % math.prod(mesh_shape[a] for a in axes) == 0 for d, axes in enumerate(dims)):
            out.append(spec(dims))
    return out


def spec(dims: Sequence[tuple[str, ...]]) -> P:
    """The ``P`` of per-dimension axes (trailing whole dimensions dropped, as ``P`` writes them)."""
    out = [(d[0] if len(d) == 1 else d) if d else None for d in dims]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def entries(s: P, ndim: int) -> list[tuple[str, ...]]:
    """The axes splitting each of ``ndim`` dimensions (``()`` for a whole one)."""
    return [tuple(s.axes_of(d)) for d in range(ndim)]


def shape_of(x: Any) -> tuple[int, ...] | None:
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
