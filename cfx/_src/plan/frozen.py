"""Frozen weights kept as a Plan keeps its state (``Placer``): sharded like ZeRO-3's params, held by
the pipeline stage that runs them, in host memory or in files. A model's frozen weights meet a plan
through two hooks (``cfx._src.models.frozen``: ``model.frozen``, ``model.place_frozen(placer)``); the
strategies decide the placer (``Strategy.place_frozen``: ``data`` under ZeRO-3 its axis, ``pipe`` its
stages, ``offload`` its home) and ``place`` applies it; the placed trees are the program's
``TrainState.frozen``.

``shard_tree(tree, specs, mesh, axis)`` cuts, for every rank this process addresses, its block of
``tree`` under ``specs`` (a model axis's split; None: whole) into ZeRO-3's flat pieces over ``axis``
(``cfx._src.zero.flat``: every leaf flattened, padded to a multiple of ``n``, piece ``r`` on rank ``r``;
``axis=None``: ``n = 1``, the whole block), packed into one shard per dtype (an int8 base: the ``q`` s
in one, the fp32 scales and norms in another). ``ShardedTree.gathered(device)`` all-gathers this rank's
shards through ZeRO-3's own mechanism for groups without gradients (``cfx.zero``'s ``frozen_gathered``):
the leaves exist while the layer runs, what autograd saves of them is re-gathered in backward, and
nothing is reduce-scattered (``axis=None``: views of the shards, nothing to gather).

Where the shards live (``home``): ``device`` (where the leaves are), ``host`` (CPU memory) or
``nvme`` (files, ``cfx.gemini``'s mapped tier: ``gemini.mapped.mapped_copy``); off the device, each
gather copies the shard to ``device`` first, so the device holds only the layer being computed.

``stage``: the coordinate along the mesh's ``pipe`` axis whose ranks hold the shards (the pipeline
stage that runs the layer); the other ranks keep none of it. Inside ``models.frozen.whole()`` (a
model's ``apply`` / ``loss``: every pipe rank runs the whole model, as ``Program.sample`` does) a
staged tree's shards are all-gathered over ``pipe`` and the holders' taken, so every rank can run
every layer; a pipeline stage gathers only its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.mapped import mapped_copy
from cfx._src.mesh.context import current
from cfx._src.models.frozen import block_at, in_whole, is_placed
from cfx._src.models.parts import hook
from cfx._src.zero.flat import GroupLayout
from cfx._src.zero import prefetch
from cfx._src.zero.gathered import frozen_gathered
from cfx._src.zero.source import ShardSource

WHERE = "a frozen tree placed as a Plan keeps its state"
PIPE = "pipe"
HOMES = ("device", "host", "nvme")


class _CopiedShard(ShardSource):
    """A shard kept away from the compute device (host memory, a file), copied to ``device`` for each gather."""

    def __init__(self, layout: GroupLayout, axis: str, shard: torch.Tensor, device: torch.device):
        super().__init__(layout, axis, [shard], shard.dtype)
        self.device = device

    def shard(self, *, backward: bool) -> torch.Tensor:
        del backward
        return self.pieces[0].to(self.device, non_blocking=True)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedTree:
    """A frozen tree as each rank's shards (module doc): ``groups`` (leaf indices, layout) per
    dtype, ``shards[rank]`` one (S,) tensor per group for the ranks that hold it, ``treedef`` the
    tree's structure, ``axis`` the axis it is sharded over (None: whole), ``stage`` the pipe
    coordinate of its holders (None: every rank)."""

    treedef: Any
    groups: tuple
    shards: dict
    axis: str | None
    stage: int | None = None

    def nbytes(self, rank: int) -> int:
        """Bytes rank ``rank`` holds of this tree (its shards; none off its stage)."""
        return sum(s.numel() * s.element_size() for s in self.shards.get(rank, ()))

    @contextlib.contextmanager
    def gathered(self, device: torch.device):
        """The whole tree (this rank's block of it under the specs it was sharded with), gathered for
        the ``with`` body, as ``device`` tensors (module doc)."""
        ctx = current(WHERE)
        shards = self.shards.get(ctx.rank)
        if self.stage is not None and in_whole():
            shards = self._from_stage(shards, device)
        assert shards is not None, f"rank {ctx.rank} runs a layer of pipe stage {self.stage} it does not hold"
        leaves: list[Any] = [None] * sum(len(g[0]) for g in self.groups)
        with contextlib.ExitStack() as stack:
            for (idx, layout, _), shard in zip(self.groups, shards):
                if self.axis is None:  # held whole: views of the shard (on the device)
                    got = layout.leaves_of_full(shard.to(device, non_blocking=True))
                else:
                    src = ShardSource(layout, self.axis, [shard], shard.dtype) if shard.device == device \
                        else _CopiedShard(layout, self.axis, shard, device)
                    got = stack.enter_context(frozen_gathered(src))
                for i, x in zip(idx, got):
                    leaves[i] = x
            yield tree_util.unflatten(self.treedef, leaves)

    def _from_stage(self, shards: tuple | None, device: torch.device) -> tuple:
        """This rank's shards as its stage's holders have them, on ``device``: all-gathered over ``pipe``
        (zeros from the ranks that hold none), the holders' row taken."""
        out = []
        for g, (_, layout, dtype) in enumerate(self.groups):
            mine = shards[g].to(device) if shards is not None else torch.zeros(layout.size, dtype=dtype, device=device)
            rows, done, order = prefetch.start(mine.detach(), PIPE)
            done()
            out.append((rows[order] if order is not None else rows)[self.stage])
        return tuple(out)


def shard_tree(tree: Any, specs: Any, mesh: Any, axis: str | None, *, home: str = "device",
               nvme_dir: str | None = None, stage: int | None = None) -> ShardedTree:
    """``tree`` as a ``ShardedTree`` over ``axis`` of ``mesh`` (None: whole), for the ranks this process
    addresses (only those of pipe coordinate ``stage``, if given), each rank's block of it under ``specs``,
    the shards at ``home`` (module doc). Fresh tensors (ranks holding the same whole block share them):
    ``tree`` may be dropped afterwards."""
    assert home in HOMES and (home != "nvme" or nvme_dir is not None), (home, nvme_dir)
    n = mesh.axes_size([axis]) if axis is not None else 1
    ranks = [r for r in mesh.local_ranks if stage is None or mesh.coords(r)[PIPE] == stage]
    leaves, treedef = tree_util.flatten(block_at(tree, specs, mesh, mesh.coords(mesh.local_ranks[0])))
    assert all(isinstance(x, torch.Tensor) for x in leaves), "a frozen base holds tensors only"
    dtypes = list(dict.fromkeys(x.dtype for x in leaves))  # one group per dtype, in order of appearance
    idxs = [tuple(i for i, x in enumerate(leaves) if x.dtype == dt) for dt in dtypes]
    groups = tuple((idx, GroupLayout(tuple(str(i) for i in idx), tuple(tuple(leaves[i].shape) for i in idx), n), dt)
                   for idx, dt in zip(idxs, dtypes))
    shards, made = {}, {}
    for rank in ranks:
        coords = mesh.coords(rank)
        leaves = tree_util.leaves(block_at(tree, specs, mesh, coords))
        piece = coords[axis] if axis is not None else 0
        key = (piece, tuple((x.untyped_storage().data_ptr(), x.storage_offset(), x.shape, x.stride()) for x in leaves))
        if key not in made:
            made[key] = tuple(_at_home(layout.shard_of([leaves[i] for i in idx], piece), home, nvme_dir)
                              for idx, layout, _ in groups)
        shards[rank] = made[key]
    return ShardedTree(treedef, groups, shards, axis, stage)


def _at_home(shard: torch.Tensor, home: str, nvme_dir: str | None) -> torch.Tensor:
    if home == "host":
        return shard.to("cpu")
    if home == "nvme":
        return mapped_copy(shard.cpu(), nvme_dir)
    return shard


@dataclasses.dataclass(frozen=True)
class Placer:
    """Where a plan keeps frozen weights on ``mesh`` (module doc): sharded over ``axis`` (None: whole),
    the shards at ``home`` (``nvme``: files under ``nvme_dir``), and with a pipe axis ``stages[c]``: the
    blocks the ranks at ``pipe`` coordinate ``c`` run, which alone hold their frozen weights."""

    mesh: Any
    axis: str | None = None
    home: str = "device"
    nvme_dir: str | None = None
    stages: tuple | None = None

    @property
    def moves(self) -> bool:
        """Whether this placer keeps anything other than the whole tree on every rank."""
        return self.axis is not None or self.home != "device" or self.stages is not None

    def place(self, tree: Any, specs: Any = None, stage: int | None = None) -> ShardedTree:
        """``tree`` (each rank's block of it under ``specs``) placed, held by the ranks of pipe coordinate
        ``stage`` (None: every rank): a placed tree (``models.frozen``)."""
        return shard_tree(tree, specs, self.mesh, self.axis, home=self.home, nvme_dir=self.nvme_dir, stage=stage)

    def stage_of(self, n: int) -> list[int | None]:
        """The pipe coordinate holding each of ``n`` blocks (None: every rank), after checking ``stages``."""
        if self.stages is None:
            return [None] * n
        p = self.mesh.shape.get(PIPE, 0)
        got = sorted(i for s in self.stages for i in s)
        if len(self.stages) != p or got != list(range(n)):
            raise ValueError(f"{WHERE}: stages must list, for each of the {p} ranks of the mesh's {PIPE!r} axis, "
                             f"the blocks it runs, every one of the {n} blocks once; got "
                             f"{[list(s) for s in self.stages]}.")
        return [c for i in range(n) for c, s in enumerate(self.stages) if i in s]


def shard_base(model: Any, mesh: Any, *, axis: str | None = "data", host: bool = False,
               nvme_dir: str | None = None, stages: Any = None) -> Any:
    """``model`` (a ``LoraModel``, or any model with frozen weights) over its frozen weights placed on
    ``mesh`` as a Plan would (``Placer``): sharded like ZeRO-3's params over ``axis`` (None: not
    sharded), in host memory (``host``) or in files under ``nvme_dir``, and with ``stages`` (a pipe
    Plan's blocks per stage) held only by the stage that runs them. Drop the whole tree afterwards:
    the result holds only the shards."""
    if axis is not None and axis not in mesh.axis_names:
        raise ValueError(f"{WHERE}: axis={axis!r} but the mesh {mesh!r} has no such axis; shard over the plan's "
                         "data axis (zero=3), e.g. axis='data'.")
    home = "nvme" if nvme_dir is not None else "host" if host else "device"
    placer = Placer(mesh, axis, home, nvme_dir, None if stages is None else tuple(tuple(s) for s in stages))
    return place(model, placer)


def place(model: Any, placer: Placer) -> Any:
    """``model`` over its frozen weights as ``placer`` keeps them (its ``place_frozen`` hook); a model
    without frozen weights, or a placer that moves nothing, gives ``model`` back."""
    place_frozen = hook(model, "place_frozen")
    if not placer.moves or not callable(place_frozen) or hook(model, "frozen") is None or placed_already(model):
        return model
    return place_frozen(placer)


def placed_already(model: Any) -> bool:
    """Whether ``model``'s frozen weights were placed already (a model places them once)."""
    return any(is_placed(x) for x in tree_util.leaves(hook(model, "frozen"), is_leaf=is_placed))


def frozen_bytes(frozen: Any, rank: int) -> int:
    """Bytes of the frozen weights ``frozen`` (a program's ``TrainState.frozen``) rank ``rank`` keeps."""
    placed = tree_util.leaves(frozen, is_leaf=is_placed)
    return sum(x.nbytes(rank) if is_placed(x) else x.numel() * x.element_size() for x in placed)
