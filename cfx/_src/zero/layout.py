"""How ``cfx.zero`` lays a params tree out: its optimizer *groups* (consecutive leaves of one
dtype, ``flat.make_groups``), the mesh axes each leaf's sum of squares sums over, the tree of this
rank's pieces over the group shards, and the specs the pieces and the optimizer state have on a
mesh (``state_specs_of``, for ``shard_map`` in/out specs across steps).

``ztx`` below is the ``ZeroTransformation`` (its ``stage``, ``axis``, ``param_specs``,
``bucket_numel`` and ``owner_axes``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.spec import P, is_spec
from cfx._src.zero.flat import GroupLayout, concat_flat, make_groups, piece_size
from cfx._src.zero.params import ZeroParams, check_axis_size, param_specs as zero_param_specs


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    n: int                                   # ranks the shards are cut for (1 at stage 0)
    paths: tuple[str, ...]
    axes: tuple[tuple[str, ...], ...]        # per leaf: the axes a piece's sum of squares sums over
    groups: tuple[tuple[tuple[int, ...], GroupLayout, torch.dtype], ...]
    treedef: Any = None                      # the params' (pieces') structure
    total_axes: tuple[tuple[str, ...], ...] = ()  # per leaf: + axes where other ranks hold other leaves


def layout_of(ztx: Any, params: Any) -> ZeroLayout:
    """The groups for ``params`` (pieces when ``stage == 3``) on this rank's mesh."""
    n = lax.axis_size(ztx.axis)  # unknown axis: ValueError on every rank, before any comm
    if ztx.stage == 3:
        if not isinstance(params, ZeroParams):
            raise ValueError(f"cfx.zero(stage=3): params must be ZeroParams (this rank's pieces); got "
                             f"{type(params).__name__}. Make them with cfx.zero.shard_params(params, "
                             f"axis={ztx.axis!r}) inside shard_map.")
        check_axis_size(params, ztx.axis, "cfx.zero(stage=3)")
        items, _ = tree_util.flatten_with_path(params.pieces)
        shapes = params.shapes
    else:
        items, _ = tree_util.flatten_with_path(params)
        shapes = [tuple(x.shape) for _, x in items]
        n = n if ztx.stage else 1
    for path, x in items:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"cfx.zero: params leaf {path or '<root>'!r} is not a floating-point tensor; "
                             "ZeRO shards floating-point params only.")
    paths = tuple(p for p, _ in items)
    extra = _extra_axes(ztx, len(paths))
    own = (ztx.axis,) if ztx.stage else ()
    groups = make_groups(paths, shapes, [x.dtype for _, x in items], n, max_numel=ztx.bucket_numel)
    owners = (list(ztx.owner_axes) if ztx.owner_axes is not None else [()] * len(paths))
    axes = tuple(own + e for e in extra)
    treedef = tree_util.structure(params.pieces if ztx.stage == 3 else params)
    return ZeroLayout(n, paths, axes, tuple((tuple(idx), lay, items[idx[0]][1].dtype) for idx, lay in groups),
                      treedef, tuple(a + tuple(o) for a, o in zip(axes, owners)))


def _extra_axes(ztx: Any, n_leaves: int) -> list[tuple[str, ...]]:
    """Per leaf: the mesh axes other than ZeRO's that its ``param_specs`` split it over."""
    if ztx.param_specs is None:
        return [()] * n_leaves
    specs = tree_util.leaves(ztx.param_specs, is_leaf=is_spec)
    if len(specs) != n_leaves:
        raise ValueError(f"cfx.zero: param_specs has {len(specs)} specs for {n_leaves} params; give "
                         "one P per params leaf (e.g. rules.specs(model.axes())).")
    return [tuple(sorted(a for a in set(s.all_axes()) if a != ztx.axis)) for s in specs]


def piece_tree(shards: list[torch.Tensor], layout: ZeroLayout) -> Any:
    """The params' tree whose leaves are this rank's pieces: views into the group shards."""
    out: list = [None] * len(layout.paths)
    for (idx, lay, _), shard in zip(layout.groups, shards):
        for i, piece in zip(idx, shard.split(lay.pieces if layout.n > 1 else lay.numels)):
            out[i] = piece
    return tree_util.unflatten(layout.treedef, out)


def group_shards(tree: Any, layout: ZeroLayout) -> list[torch.Tensor]:
    """The inverse of ``piece_tree``: one flat shard per group."""
    leaves = tree_util.leaves(tree)
    return [concat_flat([leaves[i] for i in idx]) for idx, _, _ in layout.groups]


def state_specs_of(ztx: Any, params: Any, *, mesh) -> tuple[tuple, Any]:
    """``(master, inner)`` specs of the state ``ztx.init`` makes from ``params`` (the global,
    unsharded params, even at stage 3) on ``mesh``: a state leaf shaped like a param's piece is
    split as that piece (the leaf's own axes, then ``axis``; at stage 0 the own axes only), fp32
    master shards over every axis they vary over, 0-d leaves (counts, scales) replicated."""
    if ztx.axis not in mesh.shape:
        raise ValueError(f"cfx.zero: axis {ztx.axis!r} is not an axis of {mesh!r}.")
    n = mesh.shape[ztx.axis] if ztx.stage else 1
    zp = zero_param_specs(ztx.param_specs, params, axis=ztx.axis, mesh=mesh)  # local shapes
    items = tree_util.leaves(params)
    paths = tuple(tree_util.leaf_paths(params))
    extra = _extra_axes(ztx, len(items))
    own = (ztx.axis,) if ztx.stage else ()
    groups = make_groups(paths, zp.shapes, [x.dtype for x in items], n, max_numel=ztx.bucket_numel)
    sizes = [piece_size(math.prod(s), n) for s in zp.shapes]
    piece_specs = {p: (sizes[i], P(tuple(extra[i]) + own) if extra[i] or own else P())
                   for i, p in enumerate(paths)}
    with torch.device("meta"):
        tree = tree_util.unflatten(tree_util.structure(params), [torch.empty(k) for k in sizes])
        inner = ztx.tx.init(tree)

    def spec(path: str, x) -> P:
        parts = path.split(".")
        for i in range(len(parts)):
            hit = piece_specs.get(".".join(parts[i:]))
            if hit is not None and tuple(x.shape) == (hit[0],):
                return hit[1]
        return P()
    union = tuple(sorted({a for e in extra for a in e})) + own
    keep = tuple(P(union) if items[idx[0]].dtype != torch.float32 else None for idx, _ in groups)
    return keep, tree_util.map_with_path(spec, inner)
