"""Specs over meshes: validation, a rank's block of a global tensor, and the way back.

The one place that maps a ``P`` spec and a mesh to block shapes and slices; ``ShardedArray``,
``shard_map``, ``reshard`` and ``init_sharded`` all go through it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import torch

from cfx._src.mesh.spec import P


def check_spec(path: str, shape: Sequence[int], spec: P, mesh, where: str, *, block: bool = False) -> None:
    """ValueError naming the path, the mesh and the fix unless ``spec`` can split ``shape``.

    ``block=True``: ``shape`` is one rank's block (any size fits), only the axes are checked.
    """
    if not isinstance(spec, P):
        why = "the spec must be a cfx.P, e.g. P('data', None)."
    else:  # runs per leaf on every shard_map call: worked out once per shape, spec and mesh shape
        why = _why_not(tuple(shape), spec, tuple(mesh.shape.items()), block)
    if why:
        raise ValueError(f"{where}: leaf {path or '<root>'!r} with shape {tuple(shape)} and spec {spec!r} "
                         f"on {mesh!r}: {why}")


@functools.lru_cache(maxsize=4096)
def _why_not(shape: tuple[int, ...], spec: P, mesh_shape: tuple[tuple[str, int], ...], block: bool) -> str:
    """What is wrong with ``spec`` over ``shape`` on a mesh of ``mesh_shape`` ('' if nothing)."""
    sizes = dict(mesh_shape)
    if len(spec) > len(shape):
        return f"the spec has {len(spec)} entries but the leaf only {len(shape)} dimensions; drop the extra entries."
    used: list[str] = []
    for dim in range(len(spec)):
        axes = spec.axes_of(dim)
        for a in axes:
            if a not in sizes:
                return f"unknown mesh axis {a!r}; the mesh has axes {list(sizes)}. Fix the spec or the mesh."
        used.extend(axes)
        n = math.prod(sizes[a] for a in axes)
        if not block and shape[dim] % n:
            return (f"dimension {dim} has size {shape[dim]}, not divisible by {n} (the size of "
                    f"{'x'.join(axes)}). Pad the dimension or split it over other axes.")
    if len(used) != len(set(used)):
        dup = sorted({a for a in used if used.count(a) > 1})
        return f"mesh axis {dup[0]!r} is used twice in one spec; each axis may split at most one dimension."
    return ""


def block_shape(shape: Sequence[int], spec: P, mesh) -> tuple[int, ...]:
    """The shape of one rank's block of a global ``shape`` under ``spec``."""
    out = list(shape)
    for dim in range(len(spec)):
        out[dim] //= mesh.axes_size(spec.axes_of(dim))
    return tuple(out)


def global_shape(shape: Sequence[int], spec: P, mesh) -> tuple[int, ...]:
    """The global shape whose blocks under ``spec`` have ``shape``."""
    out = list(shape)
    for dim in range(len(spec)):
        out[dim] *= mesh.axes_size(spec.axes_of(dim))
    return tuple(out)


def block_of(x: torch.Tensor, spec: P, mesh, coords: dict) -> torch.Tensor:
    """The slice (a view) of global ``x`` that the rank at ``coords`` holds under ``spec``."""
    for dim in range(len(spec)):
        axes = spec.axes_of(dim)
        if axes:
            n = mesh.axes_size(axes)
            size = x.shape[dim] // n
            x = x.narrow(dim, mesh.index_in(axes, coords) * size, size)
    return x


def is_primary(spec: P, mesh, coords: dict) -> bool:
    """True for the one rank of each replica set: coordinate 0 on every axis ``spec`` leaves out."""
    used = set(spec.all_axes())
    return not any(coords[a] for a in mesh.axis_names if a not in used)


def assemble(blocks: dict[int, Any], spec: P, mesh) -> torch.Tensor:
    """The global tensor from every rank's block (``blocks[rank]``, all ranks present; of each
    replica set, the primary's)."""
    first = blocks[0]
    out = torch.empty(global_shape(first.shape, spec, mesh), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for rank in range(mesh.size):
            coords = mesh.coords(rank)
            if is_primary(spec, mesh, coords):
                block_of(out, spec, mesh, coords).copy_(blocks[rank])
    return out
