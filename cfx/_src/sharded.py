"""``ShardedArray``: a global tensor laid out over a mesh by a spec, and ``device_put``.

Under the ``local`` backend this process addresses every rank's block; under ``dist``, its own.
``partial`` names mesh axes over which the blocks are unreduced partial sums (the global value
is their sum), the state a row-parallel matmul leaves behind before its psum.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.mesh.spec import P
from cfx._src.shard_map import assemble, block_of, check_spec


@dataclasses.dataclass(frozen=True)
class ShardedArray:
    shape: tuple[int, ...]
    spec: P
    mesh: Any
    blocks: dict[int, torch.Tensor]  # rank -> block, for the ranks this process addresses
    partial: tuple[str, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.blocks.values())).dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(next(iter(self.blocks.values())).shape)

    def gather(self) -> torch.Tensor:
        """The global tensor (every block needed: the ``local`` backend, or after ``reshard(P())``)."""
        mesh = self.mesh
        missing = [r for r in range(mesh.size) if r not in self.blocks]
        if missing and not self.partial and not any(self.spec.all_axes()):
            return next(iter(self.blocks.values())).clone()  # replicated: any block is the value
        if missing:
            raise ValueError(f"ShardedArray.gather: this process holds only ranks {sorted(self.blocks)} of "
                             f"{mesh!r}; use cfx.reshard(arr, P()) to replicate it first.")
        blocks = [self.blocks[r] for r in range(mesh.size)]
        if self.partial:
            blocks = _sum_partials(blocks, self.partial, mesh)
        return assemble(blocks, self.spec, mesh, "<array>", check_rep=False)

    def __repr__(self) -> str:
        extra = f", partial={self.partial}" if self.partial else ""
        return f"ShardedArray(shape={self.shape}, spec={self.spec!r}, {self.mesh!r}{extra})"


def _sum_partials(blocks, partial, mesh):
    out = []
    for r in range(mesh.size):
        members = mesh.group_members(partial, r)
        out.append(sum(blocks[m] for m in members))
    return out


def device_put(x: torch.Tensor, mesh, spec: P = P()) -> ShardedArray:
    """Lay ``x`` out over ``mesh`` by ``spec`` (each addressed rank gets a copy of its block)."""
    if not isinstance(spec, P):
        raise ValueError(f"cfx.device_put: spec must be a cfx.P, got {spec!r}.")
    check_spec("<array>", tuple(x.shape), spec, mesh, "cfx.device_put")
    blocks = {r: block_of(x.detach(), spec, mesh, mesh.coords(r)).clone() for r in mesh.local_ranks}
    return ShardedArray(tuple(x.shape), spec, mesh, blocks)
