"""ZeRO-3 parameters: each leaf stored as this rank's piece (see ``flat``), gathered per layer.

``ZeroParams(pieces, shapes, n)`` is the stored form of a params pytree: ``pieces`` has the
params' structure with every leaf replaced by its 1-D piece ``(ceil(numel / n),)`` on this rank
(so every rank holds the same shapes and a piece's spec is ``P(axis)``, or ``P((tp axes...,
axis))`` under tensor parallelism); ``shapes`` (static, the pytree node's metadata) are the
leaves' per-rank shapes before sharding. It is a ``cfx`` pytree node whose one child is
``pieces``: ``cfx.grad`` of a loss over ``ZeroParams`` returns ``ZeroParams`` of piece
gradients, and ``cfx.optim.apply_updates`` works on it.

Inside a gathered layer's ``apply`` the pieces travel as ``ShardedLeaf`` objects, which are
pytree *leaves*, so the tree a model sees has exactly its params' structure (its checks pass),
while each ``cfx.zero.gathered`` layer finds the pieces it must all-gather.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lax import vma
from cfx._src.mesh.spec import P, is_spec
from cfx._src.zero.flat import piece_of, piece_size


class ZeroParams:
    """This rank's pieces of a params pytree, with the leaves' shapes (module doc)."""

    __slots__ = ("pieces", "shapes", "n")

    def __init__(self, pieces: Any, shapes: tuple[tuple[int, ...], ...], n: int):
        self.pieces, self.shapes, self.n = pieces, tuple(tuple(s) for s in shapes), int(n)

    def __repr__(self) -> str:
        return f"ZeroParams(n={self.n}, leaves={len(self.shapes)})"

    def sharded_leaves(self) -> Any:
        """The params-shaped tree of ``ShardedLeaf`` (what gathered layers consume)."""
        items, treedef = tree_util.flatten(self.pieces)
        if len(items) != len(self.shapes):
            raise ValueError(f"ZeroParams: {len(items)} pieces but {len(self.shapes)} shapes; build it "
                             "with cfx.zero.shard_params.")
        return tree_util.unflatten(treedef, [ShardedLeaf(x, s, self.n) for x, s in zip(items, self.shapes)])


tree_util.register_node(
    ZeroParams,
    lambda z: ((z.pieces,), (z.shapes, z.n), ("pieces",)),
    lambda meta, children: ZeroParams(children[0], *meta),
)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedLeaf:
    """One leaf as a gathered layer receives it: this rank's piece and the leaf's shape.

    ``piece`` is a tensor (functional ZeRO-3) or None when ``source`` (a Gemini engine chunk
    reference) supplies the chunk's shard instead.
    """

    piece: torch.Tensor | None
    shape: tuple[int, ...]
    n: int
    source: Any = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def is_sharded_leaf(x: Any) -> bool:
    return isinstance(x, ShardedLeaf)


def shard_params(params: Any, *, axis: str) -> ZeroParams:
    """Inside ``shard_map``: this rank's pieces of ``params`` (replicated over ``axis``). No comm."""
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    items, treedef = tree_util.flatten_with_path(params)
    for path, x in items:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"cfx.zero.shard_params: leaf {path or '<root>'!r} is "
                             f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}; "
                             "ZeRO shards floating-point tensors only. Keep other values out of the params.")
    pieces = [piece_of(x.detach().reshape(-1), piece_size(x.numel(), n), r) for _, x in items]
    for (_, x), p in zip(items, pieces):
        memory.watch(p, tier="device", kind="param")
        if vma.is_tracking():  # each rank's own piece: varying over the axis as well as where its leaf varies
            vma.mark(p, vma.varying_axes(x) | {axis})
    return ZeroParams(tree_util.unflatten(treedef, pieces), [tuple(x.shape) for _, x in items], n)


def init_params(init, *args: Any, mesh, axis: str = "data", param_specs: Any = None) -> ZeroParams:
    """ZeRO-3's stored params built straight from ``init(*args)``: ``ZeroParams`` whose pieces are
    ShardedArrays (spec ``P((*leaf_axes, axis))``, see ``param_specs``), the blocks each process
    would get from ``shard_params`` inside ``shard_map`` -- without any process holding more than
    its pieces plus one leaf (``cfx.init_sharded``)."""
    from cfx._src.spmd.init_sharded import init_sharded
    from cfx._src.transforms.shapes import eval_shape
    specs = _param_specs(param_specs, eval_shape(init, *args), axis=axis, mesh=mesh)
    leaf_specs = tree_util.leaves(param_specs, is_leaf=is_spec) if param_specs is not None else None
    n = mesh.shape[axis]

    def pieces(*a):
        leaves, treedef = tree_util.flatten(init(*a))
        return tree_util.unflatten(treedef, [global_pieces(x, leaf_specs[i] if leaf_specs else P(), mesh, n)
                                             for i, x in enumerate(leaves)])
    arrays = init_sharded(pieces, *args, mesh=mesh, specs=specs.pieces)
    return ZeroParams(arrays, specs.shapes, n)


def global_pieces(x: torch.Tensor, spec: P, mesh, n: int) -> torch.Tensor:
    """The global tensor whose blocks under ``P((*spec's axes, axis))`` are the pieces: for each
    block of ``x`` under ``spec`` (in the order of its axes), the block flattened and padded to
    ``n`` equal pieces."""
    axes = tuple(spec.all_axes())
    blocks = [x]
    for dim in range(len(spec)):
        for a in spec.axes_of(dim):
            blocks = [part for b in blocks for part in b.chunk(mesh.shape[a], dim)]
    order = _block_order(spec, mesh) if axes else [0]
    out = []
    for i in order:
        flat = blocks[i].reshape(-1)
        k = piece_size(flat.numel(), n)
        out.append(torch.nn.functional.pad(flat, (0, k * n - flat.numel())))
    return torch.cat(out)


def _block_order(spec: P, mesh) -> list[int]:
    """Blocks enumerated by ``global_pieces`` (dims in order, each dim's axes major to minor),
    listed in the order of the spec's axes linearised major to minor (``P((axes..., data))``)."""
    axes = list(spec.all_axes())
    dim_axes = [spec.axes_of(d) for d in range(len(spec))]
    flat_axes = [a for d in dim_axes for a in d]  # the enumeration order of ``blocks``
    idx = []
    for coords in itertools.product(*[range(mesh.shape[a]) for a in axes]):
        c = dict(zip(axes, coords))
        i = 0
        for a in flat_axes:
            i = i * mesh.shape[a] + c[a]
        idx.append(i)
    return idx


def gather_params(zparams: ZeroParams, *, axis: str) -> Any:
    """Inside ``shard_map``: the full (per-rank) params from their pieces (one all-gather per leaf)."""
    check_axis_size(zparams, axis, "cfx.zero.gather_params")
    items, treedef = tree_util.flatten(zparams.pieces)
    out = []
    with torch.no_grad():
        for x, shape in zip(items, zparams.shapes):
            full = lax.all_gather(x.detach(), axis, tiled=True)
            leaf = full[:math.prod(shape)].view(shape).clone()
            if vma.is_tracking():  # the same on every rank of the axis (JAX's all_gather_invariant)
                vma.mark(leaf, vma.varying_axes(full) - {axis})
            out.append(leaf)
    return tree_util.unflatten(treedef, out)


def check_axis_size(zparams: ZeroParams, axis: str, where: str) -> None:
    n = lax.axis_size(axis)
    if zparams.n != n:
        raise ValueError(f"{where}: these ZeroParams were sharded over {zparams.n} ranks but axis "
                         f"{axis!r} has {n}; re-shard them with cfx.zero.shard_params on this mesh.")


def param_specs(param_specs_tree: Any, params: Any, *, axis: str, mesh) -> ZeroParams:
    """Specs of ``ZeroParams`` made from ``params`` (global) under ``param_specs_tree`` (per-leaf
    ``P`` of the unsharded params, e.g. tensor-parallel rules; ``None``: replicated): each piece
    is split over the leaf's own axes, then ``axis`` -- ``P((*leaf_axes, axis))``."""
    specs = tree_util.leaves(param_specs_tree, is_leaf=is_spec) if param_specs_tree is not None else None
    items, treedef = tree_util.flatten_with_path(params)
    if specs is not None and len(specs) != len(items):
        raise ValueError(f"cfx.zero.param_specs: {len(specs)} specs for {len(items)} params on {mesh!r}; "
                         "give one P per leaf (e.g. rules.specs(model.axes())).")
    n = mesh.shape[axis]
    out, shapes = [], []
    for i, (path, x) in enumerate(items):
        spec = specs[i] if specs is not None else P()
        shape = list(x.shape)
        for d in range(len(spec)):
            shape[d] //= mesh.axes_size(spec.axes_of(d))
        shapes.append(tuple(shape))
        out.append(P(tuple(spec.all_axes()) + (axis,)))
    return ZeroParams(tree_util.unflatten(treedef, out), shapes, n)


_param_specs = param_specs  # for init_params, whose keyword argument shadows the name
