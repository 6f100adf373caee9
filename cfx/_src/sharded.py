"""``ShardedArray``: the runtime's one global array -- a global shape laid out over a mesh by a
spec, holding only the blocks this process addresses.

Under the ``local`` backend this process addresses every rank's block; under ``dist``, its own.
``shard_map`` takes and returns ShardedArrays, training state is made of them between steps, and
``device_get`` turns them back into global tensors (a collective under ``dist``: every process
calls it). ``partial`` names mesh axes over which the blocks are unreduced partial sums (the
global value is their sum), the state a row-parallel matmul leaves before its psum.

A ShardedArray is a pytree leaf. It is differentiable like a tensor: ``cfx.grad`` w.r.t. a
ShardedArray returns a ShardedArray laid out the same way (see ``sharded_ad``).
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src import layout
from cfx._src.mesh.spec import P
from cfx._src.shapes import ArrayShape


class ShardedArray(ArrayShape):
    """A global array: ``shape`` (global), ``spec``, ``mesh`` and this process's ``blocks``.

    ``numel()`` / ``nbytes`` count the global array; ``addressable_nbytes``, this process's blocks."""

    __slots__ = ("shape", "spec", "mesh", "_blocks", "partial", "_anchor", "_cell", "_deleted")

    def __init__(self, shape, spec: P, mesh, blocks: dict[int, torch.Tensor], partial: tuple[str, ...] = (), *,
                 anchor: torch.Tensor | None = None, cell: Any = None):
        self.shape = tuple(int(s) for s in shape)
        self.spec, self.mesh, self._blocks, self.partial = spec, mesh, blocks, tuple(partial)
        self._anchor, self._cell, self._deleted = anchor, cell, None

    # -- blocks ----------------------------------------------------------------------------------
    @property
    def blocks(self) -> dict[int, torch.Tensor]:
        """rank -> block, for the ranks this process addresses (all under ``local``)."""
        if self._deleted is not None:
            raise ValueError(f"this ShardedArray {self._describe()} was {self._deleted}; its buffers now "
                             "hold another array's values. Use the outputs of the call it was given to.")
        return self._blocks

    def _any_block(self) -> torch.Tensor:
        return next(iter(self.blocks.values()))

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._blocks.values())).dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self._blocks.values())).device

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(next(iter(self._blocks.values())).shape)

    @property
    def addressable_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks.values())

    @property
    def is_fully_addressable(self) -> bool:
        return len(self._blocks) == self.mesh.size

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.spec.all_axes())

    @property
    def requires_grad(self) -> bool:
        return self._anchor is not None and self._anchor.requires_grad

    # -- the differentiable-leaf protocol of cfx.grad (see sharded_ad) ---------------------------
    def __cfx_grad_leaf__(self) -> "ShardedArray":
        from cfx._src import sharded_ad
        return sharded_ad.leaf(self)

    def __cfx_anchor__(self) -> torch.Tensor | None:
        return self._anchor

    def __cfx_seed__(self) -> None:
        from cfx._src import sharded_ad
        sharded_ad.seed(self)

    def __cfx_cotangent__(self) -> "ShardedArray":
        from cfx._src import sharded_ad
        return sharded_ad.cotangent(self)

    def __cfx_detached__(self) -> "ShardedArray":
        from cfx._src import sharded_ad
        return sharded_ad.detached(self)

    # -- donation ----------------------------------------------------------------------------------
    def delete(self, why: str = "deleted") -> None:
        """Mark the array unusable (its buffers were donated to a call's outputs)."""
        self._deleted = why

    def is_deleted(self) -> bool:
        return self._deleted is not None

    # -- to host values ------------------------------------------------------------------------
    def gather(self) -> torch.Tensor:
        """The global tensor (``cfx.device_get(arr)``; a collective under ``dist``)."""
        return device_get(self)

    def item(self) -> Any:
        """The value of a replicated one-element array (no communication)."""
        return self._scalar("item").item()

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __bool__(self) -> bool:
        return bool(self._scalar("bool"))

    def _scalar(self, what: str) -> torch.Tensor:
        if self.numel() != 1 or not self.is_replicated:
            raise ValueError(f"{what}() of {self._describe()}: only a replicated one-element array has one "
                             "value on every process; use cfx.device_get(arr) for the global tensor.")
        return self._any_block().detach()

    def _describe(self) -> str:
        return f"(shape={self.shape}, spec={self.spec!r}, {self.mesh!r})"

    def __repr__(self) -> str:
        extra = f", partial={self.partial}" if self.partial else ""
        dtype = str(self.dtype).removeprefix("torch.") if self._blocks else "?"
        gone = f", {self._deleted}" if self._deleted else ""
        return f"ShardedArray(shape={self.shape}, dtype={dtype}, spec={self.spec!r}, {self.mesh!r}{extra}{gone})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d ShardedArray")
        return self.shape[0]


def is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedArray)


def same_layout_mesh(a, b) -> bool:
    """True when blocks laid out on mesh ``a`` are valid blocks on mesh ``b`` (same axes, sizes,
    order and backend kind: a re-created notebook mesh accepts arrays of the old one)."""
    return a is b or (a.axis_names == b.axis_names and a.shape == b.shape
                      and a.backend.name == b.backend.name and a.local_ranks == b.local_ranks)


def device_put(x: torch.Tensor, mesh, spec: P = P()) -> ShardedArray:
    """Lay global ``x`` out over ``mesh`` by ``spec`` (each addressed rank gets a copy of its block).

    Differentiable: the gradient w.r.t. ``x`` is the global cotangent."""
    from cfx._src.shard_map import shard_map
    if not isinstance(spec, P):
        raise ValueError(f"cfx.device_put: spec must be a cfx.P, got {spec!r}.")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"cfx.device_put: expected a torch.Tensor, got {type(x).__name__}.")
    layout.check_spec("<array>", tuple(x.shape), spec, mesh, "cfx.device_put")
    return shard_map(_identity, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def _identity(x):
    return x


def device_get(tree: Any) -> Any:
    """``tree`` with every ShardedArray leaf replaced by its global ``torch.Tensor``.

    Under ``local`` the blocks are copied together (no communication); under ``dist`` each array
    is first replicated by ``reshard``'s collectives, so every process must call this with the
    same tree. Other leaves pass through. Differentiable.
    """
    from cfx._src import tree as tree_util
    from cfx._src.sharded_ad import to_global
    return tree_util.map(lambda x: to_global(x) if isinstance(x, ShardedArray) else x, tree)
