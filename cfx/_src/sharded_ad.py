"""Differentiating through ShardedArrays: each call on them is one node of the caller's graph.

A ShardedArray's blocks live in the ranks (threads under ``local``, processes under ``dist``),
and each rank's backward must run in that rank, so that the collectives' transposes pair up.
So the caller's autograd graph never sees blocks. A differentiable ShardedArray carries an
*anchor*: a 0-d tensor that stands for it in the caller's graph, and a *cell* where its
cotangent blocks (rank -> tensor) accumulate during backward. The operations that consume or
produce ShardedArrays (``shard_map``, hence ``reshard`` and ``device_put``; ``device_get``) are
``torch.autograd.Function`` s over anchors. The engine runs a node only after every consumer of
its outputs has run, so by then each output's cell holds the sum of its consumers' cotangents;
the node runs its ranks' backward (``Mesh.run``) and deposits into its inputs' cells.

``cfx.grad`` w.r.t. a ShardedArray makes a *leaf* (a fresh anchor), seeds the loss's cell with
ones, and reads the leaf's cell: a ShardedArray gradient with the input's layout.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src import layout
from cfx._src.mesh.spec import P
from cfx._src.sharded import ShardedArray


class Cell:
    """The cotangent of one differentiable ShardedArray, accumulated block by block."""

    __slots__ = ("blocks",)

    def __init__(self):
        self.blocks: dict[int, torch.Tensor] | None = None

    def add(self, blocks: dict[int, torch.Tensor]) -> None:
        if self.blocks is None:
            self.blocks = dict(blocks)
        else:
            self.blocks = {r: self.blocks[r] + b for r, b in blocks.items()}

    def take(self) -> dict[int, torch.Tensor] | None:
        out, self.blocks = self.blocks, None
        return out


def leaf(arr: ShardedArray) -> ShardedArray:
    """A differentiable copy of ``arr`` (same blocks) whose gradient ``cotangent`` returns."""
    return ShardedArray(arr.shape, arr.spec, arr.mesh, arr.blocks, arr.partial,
                        anchor=torch.zeros((), requires_grad=True), cell=Cell())


def output(arr_like: ShardedArray, anchor: torch.Tensor, cell: Cell) -> ShardedArray:
    return ShardedArray(arr_like.shape, arr_like.spec, arr_like.mesh, arr_like.blocks, arr_like.partial,
                        anchor=anchor, cell=cell)


def detached(arr: ShardedArray) -> ShardedArray:
    return arr if arr._anchor is None else ShardedArray(arr.shape, arr.spec, arr.mesh, arr.blocks, arr.partial)


def deposit(arr: ShardedArray, blocks: dict[int, torch.Tensor]) -> None:
    if arr._cell is not None:
        arr._cell.add(blocks)


def seed(arr: ShardedArray) -> None:
    """Start a backward pass at the scalar ``arr``: its cotangent is one on every rank."""
    deposit(arr, {r: torch.ones_like(b) for r, b in arr.blocks.items()})


def cotangent(arr: ShardedArray) -> ShardedArray:
    """The gradient accumulated for leaf ``arr`` (zeros where nothing reached it)."""
    got = arr._cell.take() if arr._cell is not None else None
    if got is None:
        got = {r: torch.zeros_like(b) for r, b in arr.blocks.items()}
    return ShardedArray(arr.shape, arr.spec, arr.mesh, got)


# -- device_get ---------------------------------------------------------------------------------

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
            deposit(arr, {r: layout.block_of(g, arr.spec, mesh, mesh.coords(r)).clone() for r in arr.blocks})
        return None, None


def _global_value(arr: ShardedArray) -> torch.Tensor:
    if arr.partial or not arr.is_fully_addressable:
        from cfx._src.reshard import reshard
        arr = reshard(detached(arr), P() if not arr.is_fully_addressable else arr.spec)
    if not arr.is_fully_addressable or arr.is_replicated:
        return next(iter(arr.blocks.values())).detach().clone()
    return layout.assemble({r: b.detach() for r, b in arr.blocks.items()}, arr.spec, arr.mesh, "<array>",
                           check_rep=False)


def to_global(arr: ShardedArray) -> torch.Tensor:
    """``arr``'s global value (differentiable; a collective under ``dist``)."""
    if arr.requires_grad and torch.is_grad_enabled():
        return _ToGlobal.apply(arr, arr._anchor)
    return _global_value(arr)


def grad_leaf_protocol(x: Any) -> bool:
    return isinstance(x, ShardedArray)
