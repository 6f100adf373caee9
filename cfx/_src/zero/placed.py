"""ZeRO-3 pieces placed by a Gemini policy: the ``offload`` of a functional step (a Plan's).

The pieces (one rank's params as ZeRO-3 stores them) and the optimizer state have their *home*
off the device -- host memory, or files (``gemini.mapped``: NVMe) -- the gradients arrive in host
memory, and the optimizer steps there. The
device holds only *chunk copies*: the groups' shards (one group per gathered layer: a block, or
what is left of the model) packed in execution order into equal-size chunks (``chunking``),
each copied to the device in the compute dtype when a gathered layer needs it and dropped when
a ``gemini.placer.Placer`` says: ``host`` keeps only the chunk in use, ``auto(budget)`` keeps
what its Belady plan fits in the budget, measured on a warm-up step (the first).

``Placement`` is one rank's and lives across steps (it keeps the warm-up record); each step::

    with placement.step(pieces, agree=...):        # pieces: the ZeroParams the step differentiates
        loss = gathered_model.loss(placement.tree(pieces), ...)   # and its backward

``tree`` hands the gathered layers ``ShardedLeaf``s of the same pieces (so gradients still flow
to them, through the pipeline or ``value_and_grad``) whose source serves the shard from the
chunk copy and delivers the reduce-scattered gradient home. The numbers are those of ZeRO-3
without offload: only where the bytes live changes.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable

import torch

from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.gemini.placer import Placer
from cfx._src.gemini.store import DeviceStore
from cfx._src.zero.chunking import check_budget, pack_groups
from cfx._src.zero.source import ShardSource
from cfx._src.zero.offload import gather_groups
from cfx._src.zero.params import ShardedLeaf, ZeroParams


class Placement:
    """One rank's placed pieces (module doc): ``model`` is the gathered model the step runs,
    ``local`` this rank's ``ZeroParams`` (or their ShapeDtypes), ``dtype`` the compute dtype."""

    def __init__(self, model: Any, local: ZeroParams, policy, *, dtype: torch.dtype, where: str,
                 home: str = "host"):
        items, self.treedef = tree_util.flatten_with_path(local.pieces)
        paths = [p for p, _ in items]
        self.shapes, self.n, self.dtype, self.home = local.shapes, local.n, dtype, home
        self.groups = gather_groups(model, paths)
        numels = [x.shape[0] for _, x in items]
        self.chunks = pack_groups([sum(numels[i] for i in g) for g in self.groups])
        self.chunk_bytes = [self.chunks.size * dtype.itemsize] * self.chunks.n_chunks
        if hasattr(policy, "device_budget_bytes"):  # before any rank runs
            check_budget(self.chunks, dtype.itemsize, self.n, policy.device_budget_bytes,
                         [paths[self.groups[gs[0]][0]] for gs in self.chunks.groups],
                         where=f"{where}: offload=auto", knob="the offload budget (offload=auto:<bytes>)",
                         other_fixes="offload=host (one chunk on the device at a time)")
        self.start = {}  # per leaf: where it starts in its group's shard
        for idx in self.groups:
            at = 0
            for i in idx:
                self.start[i] = at
                at += numels[i]
        self.device = DeviceStore()
        self.placer = Placer(policy, self.chunk_bytes, fetch=self._fetch, evict=self._evict)
        self.traffic: collections.Counter = collections.Counter()  # bytes by "src->dst"
        self._pieces: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def step(self, local: ZeroParams, *, agree: Callable[[torch.Tensor], torch.Tensor]):
        """One step over this rank's pieces ``local``; every chunk copy is dropped at the end."""
        self._pieces = tree_util.leaves(local.pieces)
        try:
            with self.placer.step(agree=agree):
                yield self
        finally:
            self.placer.evict_all()
            self._pieces = None

    def tree(self, local: ZeroParams) -> Any:
        """``local``'s ``ShardedLeaf`` tree, each group's leaves served by this placement."""
        leaves = [None] * len(self.shapes)
        pieces = tree_util.leaves(local.pieces)
        for g, idx in enumerate(self.groups):
            ref = _GroupRef(self, g)
            for i in idx:
                leaves[i] = ShardedLeaf(pieces[i], self.shapes[i], self.n, ref)
        return tree_util.unflatten(self.treedef, leaves)

    def leaf_indices(self, g: int, pieces: list[torch.Tensor]) -> list[int]:
        """Which of group ``g``'s leaves a gathered layer got (a pipeline stage's embedding or head
        gathers only the leaves it uses): matched by storage, as the pipeline re-wraps pieces."""
        at = {_where(self._pieces[i]): i for i in self.groups[g]}
        idx = [at.get(_where(p)) for p in pieces]
        assert None not in idx, f"leaves outside group {g} of this placement"
        return idx

    # -- the gathered layers' side ------------------------------------------------------------------
    def acquire(self, g: int, idx: list[int]) -> torch.Tensor:
        """The shard of leaves ``idx`` of group ``g``: a view of its chunk's device copy (after the
        policy's moves), or, for some of the group's leaves, their slices of it joined."""
        c = self.chunks.chunk_of[g]
        self.placer.access(c)
        shard = self.chunks.view(self.device.get(c), g)
        if idx == list(self.groups[g]):
            return shard
        return torch.cat([shard[self.start[i]:self.start[i] + self._pieces[i].numel()] for i in idx])

    def deliver(self, grad: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, ...]:
        """A reduce-scattered gradient shard of leaves ``idx`` moved home: one host tensor per
        piece (of its own, so whoever sums a piece's gradients can add into the first in place)."""
        out, dtype = [], self._pieces[idx[0]].dtype
        with torch.no_grad(), memory.ops_unwatched():  # booked as what it is: a gradient, on the host
            for i, g in zip(idx, grad.split([self._pieces[i].numel() for i in idx])):
                out.append(g.to(dtype, copy=True))
                memory.watch(out[-1], tier="host", kind="grad")
                self.traffic["device->host"] += g.numel() * g.element_size()
        return tuple(out)

    # -- the placer's moves -----------------------------------------------------------------------
    def _fetch(self, c: int) -> None:
        buf = self.device.empty(c, (self.chunks.size,), self.dtype)
        with torch.no_grad():
            buf.zero_()
            for g in self.chunks.groups[c]:
                shard = self.chunks.view(buf, g)
                for i in self.groups[g]:
                    shard[self.start[i]:self.start[i] + self._pieces[i].numel()].copy_(self._pieces[i].detach())
        self.traffic[f"{self.home}->device"] += self.chunk_bytes[c]

    def _evict(self, c: int) -> None:
        self.device.delete(c)  # a clean copy: the pieces at home are unchanged until the update


def _where(t: torch.Tensor) -> tuple[int, int, int]:
    """A piece's place: its storage, offset and size (the pipeline re-wraps pieces as new leaves)."""
    return t.untyped_storage()._cdata, t.storage_offset(), t.numel()


class _GroupRef:
    """What ``Placement.tree`` puts in each ``ShardedLeaf.source``: one per group."""

    def __init__(self, placement: Placement, group: int):
        self.placement, self.group = placement, group

    def for_layout(self, layout, axis: str, pieces: list[torch.Tensor]) -> "_PlacedSource":
        idx = self.placement.leaf_indices(self.group, pieces)
        assert list(layout.pieces) == [p.numel() for p in pieces], (layout.paths, self.group)
        return _PlacedSource(self.placement, self.group, idx, layout, axis, pieces)


class _PlacedSource(ShardSource):
    """A gathered layer's shard from its chunk's device copy; the pieces stay its autograd inputs."""

    def __init__(self, placement: Placement, group: int, idx: list[int], layout, axis: str,
                 pieces: list[torch.Tensor]):
        super().__init__(layout, axis, pieces, placement.dtype)
        self.placement, self.group, self.idx = placement, group, idx

    def shard(self, *, backward: bool) -> torch.Tensor:
        del backward
        return self.placement.acquire(self.group, self.idx)

    def deliver(self, grad: torch.Tensor) -> tuple:
        return self.placement.deliver(grad, self.idx)
