"""A frozen base sharded like ZeRO-3's params (``LoraModel.shard_base``): each rank holds ``1/n`` of it.

``shard_tree(tree, specs, mesh, axis)`` cuts, for every rank this process addresses, its block of
``tree`` under ``specs`` (a model axis's split; None: whole) into ZeRO-3's flat pieces over ``axis``
(``cfx._src.zero.flat``: every leaf flattened, padded to a multiple of ``n``, piece ``r`` on rank ``r``),
packed into one shard per dtype (an int8 base: the ``q`` s in one, the fp32 scales and norms in
another). ``ShardedBase.gathered(device)`` all-gathers this rank's shards through ZeRO-3's own
mechanism for groups without gradients (``cfx.zero``'s ``frozen_gathered``): the leaves exist while
the layer runs, what autograd saves of them is re-gathered in backward, and nothing is reduce-scattered.
With ``device`` differing from where the shards live (``host=True``: CPU), each gather copies the
shard to ``device`` first, so the device holds only the layer being computed.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh.context import current
from cfx._src.mesh.layout import block_of
from cfx._src.mesh.spec import P, is_spec
from cfx._src.nn.lora_weight import is_weight_node
from cfx._src.precision.quant import QuantizedWeight
from cfx._src.zero.flat import GroupLayout
from cfx._src.zero.gathered import ShardSource, frozen_gathered

WHERE = "cfx.lora model"


def block_at(tree: Any, specs: Any, mesh: Any, coords: dict) -> Any:
    """The block of the global ``tree`` that the rank at ``coords`` holds under ``specs`` (a pytree of
    ``P`` shaped like it, weights as single leaves; None: the whole tree): views, no copies. An int8
    weight's ``q`` splits as its spec says, its per-column ``scale`` with the output dim."""
    if specs is None:
        return tree
    leaves, treedef = tree_util.flatten(tree, is_leaf=is_weight_node)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))

    def local(x: Any, spec: P) -> Any:
        if isinstance(x, QuantizedWeight):
            out = P(*tuple(spec)[1:2])  # (out,) scales split with the weight's columns
            return QuantizedWeight(block_of(x.q, spec, mesh, coords), block_of(x.scale, out, mesh, coords))
        return block_of(x, spec, mesh, coords) if isinstance(x, torch.Tensor) else x
    return tree_util.unflatten(treedef, [local(x, s) for x, s in zip(leaves, spec_leaves)])


class _CopiedShard(ShardSource):
    """A shard kept away from the compute device (the host), copied to ``device`` for each gather."""

    def __init__(self, layout: GroupLayout, axis: str, shard: torch.Tensor, device: torch.device):
        super().__init__(layout, axis, [shard], shard.dtype)
        self.device = device

    def shard(self, *, backward: bool) -> torch.Tensor:
        del backward
        return self.pieces[0].to(self.device, non_blocking=True)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedBase:
    """A frozen params tree as each rank's shards (module doc): ``groups`` (leaf indices, layout) per
    dtype, ``shards[rank]`` one (S,) tensor per group, ``treedef`` the tree's structure."""

    treedef: Any
    groups: tuple
    shards: dict
    axis: str

    def nbytes(self, rank: int) -> int:
        """Bytes rank ``rank`` holds of this tree (its shards)."""
        return sum(s.numel() * s.element_size() for s in self.shards[rank])

    @contextlib.contextmanager
    def gathered(self, device: torch.device):
        """The whole tree (this rank's block of it under the specs it was sharded with), gathered for
        the ``with`` body, as ``device`` tensors (module doc)."""
        ctx = current(WHERE)
        leaves: list[Any] = [None] * sum(len(idx) for idx, _ in self.groups)
        with contextlib.ExitStack() as stack:
            for (idx, layout), shard in zip(self.groups, self.shards[ctx.rank]):
                src = ShardSource(layout, self.axis, [shard], shard.dtype) if shard.device == device \
                    else _CopiedShard(layout, self.axis, shard, device)
                for i, x in zip(idx, stack.enter_context(frozen_gathered(src))):
                    leaves[i] = x
            yield tree_util.unflatten(self.treedef, leaves)


def shard_tree(tree: Any, specs: Any, mesh: Any, axis: str, *, device: Any = None) -> ShardedBase:
    """``tree`` as a ``ShardedBase`` over ``axis`` of ``mesh``, for the ranks this process addresses,
    each rank's block of it under ``specs`` (module doc); the shards on ``device`` (None: where the
    leaves are). Fresh tensors: ``tree`` may be dropped afterwards."""
    n = mesh.axes_size([axis])
    groups, treedef, shards = None, None, {}
    for rank in mesh.local_ranks:
        coords = mesh.coords(rank)
        leaves, treedef = tree_util.flatten(block_at(tree, specs, mesh, coords))
        assert all(isinstance(x, torch.Tensor) for x in leaves), "a frozen base holds tensors only"
        if groups is None:
            dtypes = list(dict.fromkeys(x.dtype for x in leaves))  # one group per dtype, in order of appearance
            idxs = [tuple(i for i, x in enumerate(leaves) if x.dtype == dt) for dt in dtypes]
            groups = tuple((idx, GroupLayout(tuple(str(i) for i in idx), tuple(tuple(leaves[i].shape) for i in idx), n))
                           for idx in idxs)
        shards[rank] = tuple(layout.shard_of([leaves[i] for i in idx], coords[axis]).to(device or leaves[idx[0]].device)
                             for idx, layout in groups)
    return ShardedBase(treedef, groups, shards, axis)
