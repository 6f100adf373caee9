"""Moving ShardedArrays: ``device_put``, ``device_get`` and ``reshard``, all differentiable.

``device_put`` and ``reshard`` are ``shard_map`` s of the identity (the input conversion does
the work: slicing a global tensor, or ``reshard_plan``'s collectives inside the ranks);
``device_get`` copies blocks together under ``local`` and replicates by collectives first under
``dist``, so there every process must call it.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.mesh import layout
from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.sharded import ShardedArray
from cfx._src.spmd.spec_tree import broadcast_specs


def _identity(x):
    return x


def device_put(x: Any, mesh, spec: Any = P()) -> Any:
    """Lay global ``x`` out over ``mesh`` by ``spec`` (each addressed rank gets a copy of its block).

    ``x`` is a tensor or a pytree of them; ``spec`` a ``P``, or a pytree of them shaped like ``x``
    or like a prefix of it (one ``P`` for a whole subtree, as ``shard_map``'s ``in_specs``), e.g.
    ``device_put(params, mesh, rules.specs(model.axes()))``. Differentiable: the gradient w.r.t.
    ``x`` is the global cotangent."""
    if not hasattr(mesh, "axis_names"):  # (None, a dict of axes, a torch DeviceMesh)
        raise ValueError(f"cfx.device_put: mesh must be a cfx.Mesh, got {type(mesh).__name__}; e.g. "
                         "with cfx.Mesh({'data': 2}) as mesh: cfx.device_put(x, mesh, cfx.P('data')).")
    if isinstance(x, torch.Tensor):
        if not isinstance(spec, P):
            raise ValueError(f"cfx.device_put: a tensor takes one cfx.P as its spec, got {spec!r}.")
        layout.check_spec("<array>", tuple(x.shape), spec, mesh, "cfx.device_put")
        return shard_map(_identity, mesh=mesh, in_specs=spec, out_specs=spec)(x)
    for path, leaf, s in broadcast_specs(spec, x, "specs", mesh, where="cfx.device_put"):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"cfx.device_put: leaf {path!r} is a {type(leaf).__name__}, not a torch.Tensor; "
                             "put tensors (cfx.device_get brings ShardedArrays back first).")
        layout.check_spec(path, tuple(leaf.shape), s, mesh, "cfx.device_put")
    return shard_map(_identity, mesh=mesh, in_specs=(spec,), out_specs=spec)(x)


def reshard(arr: ShardedArray, spec: P) -> ShardedArray:
    """``arr`` laid out by ``spec``, moved by the cheapest plan (``reshard_plan``); differentiable."""
    if not isinstance(arr, ShardedArray):
        raise ValueError(f"cfx.reshard: expected a ShardedArray (from cfx.device_put or shard_map), got "
                         f"{type(arr).__name__}.")
    if not isinstance(spec, P):
        raise ValueError(f"cfx.reshard: spec must be a cfx.P, got {spec!r}.")
    return shard_map(_identity, mesh=arr.mesh, in_specs=spec, out_specs=spec)(arr)


def device_get(tree: Any) -> Any:
    """``tree`` with every ShardedArray leaf replaced by its global ``torch.Tensor``.

    Under ``local`` the blocks are copied together (no communication); under ``dist`` each array
    is first replicated by ``reshard``'s collectives, so every process must call this with the
    same tree. Other leaves pass through. Differentiable.
    """
    return tree_util.map(lambda x: _to_global(x) if isinstance(x, ShardedArray) else x, tree)


def _to_global(arr: ShardedArray) -> torch.Tensor:
    if arr.requires_grad and torch.is_grad_enabled():
        return _ToGlobal.apply(arr, arr._anchor)
    return _global_value(arr)


class _ToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, arr, anchor):
        del anchor
        ctx.arr = arr
        return _global_value(arr)

    @staticmethod
    def backward(ctx, g):
        arr, ctx.arr = ctx.arr, None
        if g is not None:  # a partial array's cotangent is the global one on every rank (sum's transpose)
            mesh = arr.mesh
            arr.deposit({r: layout.block_of(g, arr.spec, mesh, mesh.coords(r)).clone() for r in arr.blocks})
        return None, None


def _global_value(arr: ShardedArray) -> torch.Tensor:
    if not arr.is_fully_addressable and not arr.is_replicated:
        arr = reshard(arr.__cfx_detached__(), P())  # dist: replicate by collectives, then any block is it
    return arr.gather()
