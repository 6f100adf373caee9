"""Specs for optimizer state, and data-parallel gradient averaging in one flat all-reduce
(global norms across shards: ``cfx.optim.sharded``)."""
from __future__ import annotations

import functools
from typing import Any

import torch

from cfx._src.core import donation
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lax import vma
from cfx._src.mesh.spec import P, is_spec


def state_specs(state: Any, params: Any, param_specs: Any) -> Any:
    """Specs for an optimizer state: a leaf whose path ends with a param's path and has that
    param's shape (moments, momentum buffers) gets the param's spec; counters etc. get ``P()``.
    Leaves may be tensors, ``ShapeDtype`` s (``cfx.eval_shape``) or ShardedArrays."""
    by_path = {}
    spec_leaves = tree_util.leaves(param_specs, is_leaf=is_spec)
    for (path, p), spec in zip(tree_util.flatten_with_path(params)[0], spec_leaves):
        by_path[path] = (tuple(p.shape), spec)

    def pick(path: str, leaf: Any) -> P:
        parts = path.split(".")
        for i in range(len(parts)):
            hit = by_path.get(".".join(parts[i:]))
            if hit is not None and hasattr(leaf, "shape") and tuple(leaf.shape) == hit[0]:
                return hit[1]
        return P()
    return tree_util.map_with_path(pick, state)


def tree_pmean(tree: Any, axis: str) -> Any:
    """``pmean`` of every floating leaf over ``axis`` as ONE flat all-reduce (bucketed DP sync);
    each leaf comes back typed (``cfx.lax.varying_axes``) as ``cfx.lax.pmean`` types it (in a body
    that tracks types, one all-reduce per type of leaf: ``_by_type``)."""
    return _flat_reduce(tree, axis, mean=True)


def tree_psum(tree: Any, axis: str) -> Any:
    """``psum`` of every floating leaf over ``axis`` as ONE flat all-reduce (one per type of leaf
    where types are tracked), each leaf typed as ``cfx.lax.psum`` types it."""
    return _flat_reduce(tree, axis, mean=False)


def _flat_reduce(tree: Any, axis: str, *, mean: bool) -> Any:
    items, treedef = tree_util.flatten(tree)
    floats = [i for i, x in enumerate(items) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    out = list(items)
    for group in _by_type(items, floats):
        for i, x in zip(group, _reduce_group([items[i] for i in group], axis, mean)):
            out[i] = x
    return tree_util.unflatten(treedef, out)


def _by_type(items: list, floats: list[int]) -> list[list[int]]:
    """The float leaves by varying-axes type: one group, unless a tracking ``shard_map`` body
    (``check_vma=True``, or differentiated from outside) passes leaves of several types. Each
    group's flat all-reduce then types (and, differentiated, transposes) every leaf as the
    leafwise collective would; one flat buffer over several types would give each the union."""
    if not vma.is_tracking():
        return [floats] if floats else []
    groups: dict[frozenset, list[int]] = {}
    for i in floats:
        groups.setdefault(vma.varying_axes(items[i]), []).append(i)
    return list(groups.values())


def _reduce_group(xs: list[torch.Tensor], axis: str, mean: bool) -> list[torch.Tensor]:
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in xs), torch.float32)  # fp64 stays
    flat = torch.cat([x.reshape(-1).to(dtype) for x in xs])
    if flat.requires_grad:
        flat = (lax.pmean if mean else lax.psum)(flat, axis)
    else:  # the flat copy is ours: reduce and scale it in place (no second copy of the model)
        with donation.donated([flat]):
            flat = lax.psum(flat, axis)
        if mean:
            flat.div_(lax.axis_size(axis))
    out, offset = [], 0
    for x in xs:  # .view(shape), not view_as(x): the result takes flat's type, not x's
        out.append(flat[offset:offset + x.numel()].view(x.shape).to(x.dtype))
        offset += x.numel()
    return out
