"""``ShardedArray``: the runtime's one global array -- a global shape laid out over a mesh by a
spec, holding only the blocks this process addresses.

Under the ``local`` backend this process addresses every rank's block; under ``dist``, its own.
``shard_map`` takes and returns ShardedArrays, training state is made of them between steps, and
``device_get`` turns them back into global tensors (a collective under ``dist``: every process
calls it). ``partial`` names mesh axes over which the blocks are unreduced partial sums (the
global value is their sum), the state a row-parallel matmul leaves before its psum.

A ShardedArray is a pytree leaf. It is differentiable like a tensor: ``cfx.grad`` w.r.t. a
ShardedArray returns a ShardedArray laid out the same way. Its blocks live in the ranks (threads
under ``local``, processes under ``dist``), and each rank's backward must run in that rank so that
the collectives' transposes pair up; so the caller's autograd graph never sees blocks. A
differentiable ShardedArray carries an *anchor*, a 0-d tensor that stands for it in the caller's
graph, and a *cell* where its cotangent blocks (rank -> tensor) accumulate during backward. The
calls that consume or produce ShardedArrays (``shard_map``; ``device_get``) are
``torch.autograd.Function`` s over anchors: the engine runs a node only after every consumer of
its outputs has run, so by then each output's cell holds the sum of its consumers' cotangents;
the node runs its ranks' backward (``Mesh.run``) and deposits into its inputs' cells.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.mesh import layout
from cfx._src.mesh.spec import P
from cfx._src.transforms.shapes import ArrayShape


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

    # -- the differentiable-leaf protocol of cfx.grad (module doc) --------------------------------
    def __cfx_grad_leaf__(self) -> "ShardedArray":
        """A differentiable copy (same blocks) whose gradient ``__cfx_cotangent__`` returns."""
        return self.with_anchor(torch.zeros((), requires_grad=True), Cell())

    def __cfx_anchor__(self) -> torch.Tensor | None:
        return self._anchor

    def __cfx_seed__(self) -> None:
        """Start a backward pass at this scalar: its cotangent is one on every rank."""
        self.deposit({r: torch.ones_like(b) for r, b in self.blocks.items()})

    def __cfx_cotangent__(self) -> "ShardedArray":
        """The gradient accumulated for this leaf (zeros where nothing reached it)."""
        got = self._cell.take() if self._cell is not None else None
        if got is None:
            got = {r: torch.zeros_like(b) for r, b in self.blocks.items()}
        return ShardedArray(self.shape, self.spec, self.mesh, got)

    def __cfx_detached__(self) -> "ShardedArray":
        return self if self._anchor is None else ShardedArray(self.shape, self.spec, self.mesh, self.blocks,
                                                               self.partial)

    def with_anchor(self, anchor: torch.Tensor, cell: "Cell") -> "ShardedArray":
        return ShardedArray(self.shape, self.spec, self.mesh, self.blocks, self.partial, anchor=anchor, cell=cell)

    def deposit(self, blocks: dict[int, torch.Tensor]) -> None:
        """Add cotangent blocks to this array's cell (during a backward pass)."""
        if self._cell is not None:
            self._cell.add(blocks)

    # -- donation ----------------------------------------------------------------------------------
    def delete(self, why: str = "deleted") -> None:
        """Mark the array unusable (its buffers were donated to a call's outputs)."""
        self._deleted = why

    def is_deleted(self) -> bool:
        return self._deleted is not None

    # -- to host values ------------------------------------------------------------------------
    def gather(self) -> torch.Tensor:
        """The global tensor from the blocks this process holds, without communication: every
        block under ``local``, or a replicated array anywhere. ``cfx.device_get`` does the rest
        (a collective under ``dist``) and is differentiable."""
        if not self.is_fully_addressable:
            if self.is_replicated:
                return self._any_block().detach().clone()
            raise ValueError(f"ShardedArray.gather: this process holds only ranks {sorted(self.blocks)} of "
                             f"{self.mesh!r}; call cfx.device_get(arr) on every process (it replicates the "
                             "array by collectives first).")
        blocks = {r: b.detach() for r, b in self.blocks.items()}
        if self.partial:  # the global value is the sum of the partial blocks
            blocks = {r: sum(blocks[m] for m in self.mesh.group_members(self.partial, r)) for r in blocks}
        return layout.assemble(blocks, self.spec, self.mesh)

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

    def __str__(self) -> str:
        """``repr`` and the global value (``print(arr)``), as a JAX Array prints; only where this
        process holds every block (``local``; under ``dist`` values live on other processes)."""
        if self._deleted or self.partial or not self.is_fully_addressable:
            return repr(self)
        with torch.no_grad():
            value = str(self.gather()).replace("\n", "\n  ")
        return f"{self!r}\n  {value}"

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
