"""A Plan's state saved and loaded in model coordinates (``coords``), so any plan resumes it.

``save``: every process writes the regions its ranks own (the lowest rank holding a region
writes it: replicas once), each cut into rectangles of the model-coordinate leaf (``Region.boxes``),
as one sharded checkpoint (``checkpoint_sharded.save_boxes``). ``load``: each region a rank
holds is read from the checkpoint into its blocks (the template's, donated), rectangle by
rectangle, so a process holds its blocks plus one slice. A checkpoint saved on ``{"data": 4}`` with ZeRO-3 thus
loads onto ``{"data": 2, "model": 2}``, a pipe axis, another ZeRO stage, or -- as whole tensors
with ``cfx.checkpoint.load`` -- one device.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from cfx._src.checkpoint import sharded as checkpoint_sharded
from cfx._src.core import tree as tree_util
from cfx._src.plan.coords import ModelCoords, Region
from cfx._src.transforms.shapes import eval_shape


class StateFiles:
    """Saving and loading one program's ``TrainState`` (``params``, ``opt_state``) in model
    coordinates; ``tx`` is the optimizer the plan was given (its state over the model's params
    is the checkpoint's ``opt_state``)."""

    def __init__(self, layout, mesh, tx, *, zero: int, clipped: bool, plan: str):
        self.coords = ModelCoords(layout, mesh, zero=zero, clipped=clipped)
        self.mesh, self.plan = mesh, plan
        leaves = {}
        for name, tree in (("params", layout.model_shapes), ("opt_state", eval_shape(tx.init, layout.model_shapes))):
            for path, x in tree_util.flatten_with_path(tree)[0]:
                leaves[f"{name}.{path}" if path else name] = (tuple(x.shape), x.dtype)
        self.leaves = leaves
        self._owners: dict[Region, int] | None = None

    # -- saving ------------------------------------------------------------------------------------
    def save(self, directory: str, state: Any, *, metadata: dict | None = None) -> None:
        ranks = self.mesh.local_ranks
        params, opt_state = _blocks(state.params, ranks), _blocks(state.opt_state, ranks)
        owners = self._owners_of(params, opt_state)
        boxes: dict[str, list] = {}
        for rank in self.mesh.local_ranks:
            for region, t in self.coords.entries(rank, params[rank], opt_state[rank]):
                if owners[region] != rank:
                    continue
                if t.dtype != self.leaves[region.path][1]:
                    raise ValueError(f"cfx.checkpoint: {region.path!r} is {t.dtype} in plan {self.plan!r}'s state but "
                                     f"{self.leaves[region.path][1]} in the optimizer's state over the model's params; "
                                     "save the state this program's init and step return.")
                boxes.setdefault(region.path, []).extend(_cut(region, t))
        checkpoint_sharded.save_boxes(directory, self.leaves, boxes, metadata={**(metadata or {}), "plan": self.plan})

    def _owners_of(self, params: dict, opt_state: dict) -> dict[Region, int]:
        """Who writes each region, checked once: the regions tile every model-coordinate leaf."""
        if self._owners is None:
            r = self.mesh.local_ranks[0]
            owners = self.coords.owners(params[r], opt_state[r])
            count = {path: 0 for path in self.leaves}
            for region in owners:
                if region.path not in count:
                    raise ValueError(f"cfx.checkpoint: plan {self.plan!r} holds {region.path!r}, which the optimizer's "
                                     "state over the model's params does not have; save the state this program's "
                                     "init and step return.")
                count[region.path] += region.numel
            short = [p for p, n in count.items() if n != math.prod(self.leaves[p][0])]
            if short:
                raise ValueError(f"cfx.checkpoint: plan {self.plan!r}'s state does not cover {short[:3]} once in model "
                                 "coordinates; save the state this program's init and step return.")
            self._owners = owners
        return self._owners

    # -- loading -----------------------------------------------------------------------------------
    def load(self, directory: str, like: Any) -> tuple[Any, Any, dict]:
        """``(params, opt_state, metadata)`` read into ``like``'s blocks (this program's state,
        donated: no second copy of the state is made)."""
        with checkpoint_sharded.Stored(directory) as stored:
            self._check(stored)
            for a in tree_util.leaves(like):  # ZeRO pieces' padding is no element of the state: zero
                for b in a.blocks.values():
                    b.zero_()
            ranks = self.mesh.local_ranks
            params, opt_state = _blocks(like.params, ranks), _blocks(like.opt_state, ranks)
            for rank in self.mesh.local_ranks:
                for region, t in self.coords.entries(rank, params[rank], opt_state[rank]):
                    for (lo, size, _), dst in zip(region.boxes(), _cut(region, t)):
                        dst[1].copy_(stored.region(region.path, lo, size))
            return like.params, like.opt_state, stored.metadata

    def _check(self, stored: checkpoint_sharded.Stored) -> None:
        saved = stored.metadata.get("plan", "?")
        try:
            stored.check_leaves(list(self.leaves))
        except ValueError as e:
            raise ValueError(f"{e} (It was saved by plan {saved!r}; this is {self.plan!r}: the model or the "
                             "optimizer differs.)") from None
        for path, (shape, dtype) in self.leaves.items():
            if stored.shape(path) != shape or stored.dtype(path) != dtype:
                have = f"{str(stored.dtype(path)).removeprefix('torch.')} {stored.shape(path)}"
                want = f"{str(dtype).removeprefix('torch.')} {shape}"
                raise ValueError(f"cfx.checkpoint.load: {path!r} is {have} in {stored.directory!r} but {want} "
                                 "here: it was saved with another model "
                                 "config or optimizer. Build the program with the ones that wrote it.")


def _blocks(tree: Any, ranks: list[int]) -> dict[int, Any]:
    """Per local rank: ``tree`` (of ShardedArrays) with each leaf that rank's block."""
    return {r: tree_util.map(lambda a, r=r: a.blocks[r], tree) for r in ranks}


def _cut(region: Region, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``[(global offsets, view of t)]``: ``t`` (the region's tensor) as the region's rectangles."""
    if region.flat is None:
        return [(region.lo, t)]
    return [(lo, t[s:s + math.prod(size)].view(size)) for lo, size, s in region.boxes()]
