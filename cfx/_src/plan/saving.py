"""A Plan's state saved and loaded in model coordinates (``coords``), so any plan resumes it.

``save``: every process writes the regions its ranks own (the lowest rank holding a region
writes it: replicas once), each cut into rectangles of the model-coordinate leaf (``Region.boxes``),
as one sharded checkpoint (``checkpoint_sharded.save_boxes``); to a ``.safetensors`` path the
regions are put together into whole tensors instead (``whole``) and process 0 writes them as one
file: the single-device state, which one device resumes as it is. ``load``: each region a rank
holds is read from a checkpoint of either kind -- or a single device's file -- into its blocks (the
template's, donated), rectangle by rectangle, so a process holds its blocks plus one slice (plus,
from a file, the leaves read whole). A checkpoint saved on ``{"data": 4}`` with ZeRO-3 thus loads
onto ``{"data": 2, "model": 2}``, a pipe axis, another ZeRO stage, or -- as whole tensors with
``cfx.checkpoint.load`` -- one device. A checkpoint of another model or optimizer is a ValueError
that says what differs (``state_differences``: "the checkpoint has 4 blocks, the model 8").
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from cfx._src.checkpoint import file as checkpoint_file, sharded as checkpoint_sharded
from cfx._src.core import tree as tree_util
from cfx._src.plan.coords import ModelCoords, Region
from cfx._src.transforms.shapes import eval_shape


def model_leaves(params: Any, tx: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{path: (shape, dtype)}`` of the state in model coordinates: ``params.<path>`` of the
    model's params (arrays or shapes), ``opt_state.<path>`` of ``tx``'s state over them, in order."""
    leaves = {}
    for name, tree in (("params", params), ("opt_state", eval_shape(tx.init, params))):
        for path, x in tree_util.flatten_with_path(tree)[0]:
            leaves[f"{name}.{path}" if path else name] = (tuple(x.shape), x.dtype)
    return leaves


class StateFiles:
    """Saving and loading one program's ``TrainState`` (``params``, ``opt_state``) in model
    coordinates; ``tx`` is the optimizer the plan was given (its state over the model's params
    is the checkpoint's ``opt_state``)."""

    def __init__(self, layout, mesh, tx, *, zero: int, clipped: bool, plan: str):
        self.coords = ModelCoords(layout, mesh, zero=zero, clipped=clipped)
        self.mesh, self.plan = mesh, plan
        self.leaves = model_leaves(layout.model_shapes, tx)
        self._owners: dict[Region, int] | None = None

    # -- saving ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: Any, *, metadata: dict | None = None, async_: bool = False):
        """``state`` at ``path``: a directory of every process's regions, or, for a ``.safetensors``
        path, one file of whole tensors (module doc). Every process calls it. With ``async_`` the
        regions are copied to host memory and written in the background (the ``PendingSave``)."""
        metadata = {**(metadata or {}), "plan": self.plan}
        if os.fspath(path).endswith(".safetensors"):
            tensors = self.whole(state)  # new tensors: the state may change while they are written
            if 0 in self.mesh.local_ranks:  # the process of rank 0 writes
                return checkpoint_file.save(path, tensors, metadata=metadata, async_=async_)
            return None
        boxes: dict[str, list] = {}
        for region, t in self._owned(state):
            boxes.setdefault(region.path, []).extend(_cut(region, t))
        return checkpoint_sharded.save_boxes(path, self.leaves, boxes, metadata=metadata, async_=async_)

    def whole(self, state: Any) -> dict[str, torch.Tensor]:
        """``{path: whole tensor}``: every model-coordinate leaf of ``state``, on the CPU (under
        ``dist`` a collective: process 0 receives them; the other processes' tensors are no use)."""
        out = {path: torch.zeros(shape, dtype=dtype) for path, (shape, dtype) in self.leaves.items()}
        for region, t in self._owned(state):
            for lo, box in _cut(region, t):
                out[region.path][tuple(slice(a, a + n) for a, n in zip(lo, box.shape))].copy_(box)
        if len(self.mesh.local_ranks) < self.mesh.size:  # the other processes' regions: summed into 0's
            import torch.distributed as dist
            for t in out.values():  # each element is written by one process, zeros elsewhere
                dist.reduce(t, dst=0)
        return out

    def _owned(self, state: Any):
        """``(region, tensor)`` for every region that a rank of this process writes (module doc)."""
        ranks = self.mesh.local_ranks
        params, opt_state = _blocks(state.params, ranks), _blocks(state.opt_state, ranks)
        owners = self._owners_of(params, opt_state)
        for rank in ranks:
            for region, t in self.coords.entries(rank, params[rank], opt_state[rank]):
                if owners[region] != rank:
                    continue
                if t.dtype != self.leaves[region.path][1]:
                    raise ValueError(f"cfx.checkpoint: {region.path!r} is {t.dtype} in plan {self.plan!r}'s state but "
                                     f"{self.leaves[region.path][1]} in the optimizer's state over the model's params; "
                                     "save the state this program's init and step return.")
                yield region, t

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
    def load(self, source: Any, like: Any) -> tuple[Any, Any, dict]:
        """``(params, opt_state, metadata)`` read into ``like``'s blocks (this program's state,
        donated: no second copy of the state is made). ``source``: a checkpoint's path -- a directory
        of any plan's regions, or one file of whole tensors (a plan's or a single device's) -- or a
        checkpoint already open (``checkpoint.file.open_stored``'s interface)."""
        if isinstance(source, (str, os.PathLike)):
            with checkpoint_file.open_stored(source) as stored:
                return self.load(stored, like)
        stored = source
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

    def _check(self, stored: Any) -> None:
        have = {path: (stored.shape(path), stored.dtype(path)) for path in stored.leaves}
        if have != self.leaves:
            saved = stored.metadata.get("plan", "one device")
            raise ValueError(f"cfx.checkpoint.load: {stored.path!r} is not this program's state: "
                             f"{state_differences(have, self.leaves)}. Build the program with the model and optimizer "
                             f"that wrote it (it was saved by plan {saved!r}, this is {self.plan!r}: the mesh, ZeRO "
                             "stage and pipe axis may differ).")


def state_differences(stored: dict[str, tuple], wanted: dict[str, tuple]) -> str:
    """How a checkpoint's leaves (``stored``: path -> ``(shape, dtype)``) differ from the model's
    and optimizer's at hand (``wanted``), in words: the params first (the optimizer state's
    differences follow from theirs) -- numbered lists of another length ("the checkpoint has 4
    blocks, the model 8"), leaves one side lacks, shapes and dtypes; "" when none differ."""
    for part, whose in (("params", "the model"), ("opt_state", "the optimizer")):
        have = {p: v for p, v in stored.items() if p.split(".", 1)[0] == part}
        want = {p: v for p, v in wanted.items() if p.split(".", 1)[0] == part}
        said = _differences(have, want, whose, lists=part == "params")
        if said:
            return "; ".join(said)
    missing, extra = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    return f"missing {missing[:5]}, unexpected {extra[:5]}" if missing or extra else ""


def _differences(have: dict, want: dict, whose: str, *, lists: bool) -> list[str]:
    if lists:  # the model's numbered lists (its blocks): their lengths say it all
        a, b = _list_lengths(have), _list_lengths(want)
        said = [f"the checkpoint has {a[k]} {k.rsplit('.', 1)[-1]}, {whose} {b[k]}" for k in sorted(a.keys() & b.keys())
                if a[k] != b[k]]
        if said:
            return said
    extra, missing = sorted(have.keys() - want.keys()), sorted(want.keys() - have.keys())
    if extra or missing:
        if not lists:  # an optimizer's state: how many tensors, and the first names unknown to the other
            return [f"the checkpoint's optimizer state has {len(have)} tensors{_named(extra)} where "
                    f"{whose}'s has {len(want)}{_named(missing)}"]
        return ([f"the checkpoint has {_few(extra)}, which {whose} lacks"] if extra else []) + \
            ([f"{whose} has {_few(missing)}, which the checkpoint lacks"] if missing else [])
    return [f"{p!r} is {_kind(have[p])} in the checkpoint, {_kind(want[p])} in {whose}"
            for p in sorted(have) if have[p] != want[p]][:3]


def _list_lengths(leaves: dict) -> dict[str, int]:
    """``{prefix: length}`` of the numbered lists among the paths (``params.blocks.3.w``: ``blocks``)."""
    out: dict[str, int] = {}
    for path in leaves:
        m = re.match(r"(.*?)\.(\d+)(\.|$)", path)
        if m:
            out[m[1]] = max(out.get(m[1], 0), int(m[2]) + 1)
    return out


def _few(paths: list[str]) -> str:
    return ", ".join(repr(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _named(paths: list[str]) -> str:
    return f" ({_few(paths)})" if paths else ""


def _kind(leaf: tuple) -> str:
    shape, dtype = leaf
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)}"


def _blocks(tree: Any, ranks: list[int]) -> dict[int, Any]:
    """Per local rank: ``tree`` (of ShardedArrays) with each leaf that rank's block."""
    return {r: tree_util.map(lambda a, r=r: a.blocks[r], tree) for r in ranks}


def _cut(region: Region, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``[(global offsets, view of t)]``: ``t`` (the region's tensor) as the region's rectangles."""
    if region.flat is None:
        return [(region.lo, t)]
    return [(lo, t[s:s + math.prod(size)].view(size)) for lo, size, s in region.boxes()]
