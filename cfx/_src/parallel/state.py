"""Specs for optimizer state, and data-parallel gradient averaging in one flat all-reduce
(global norms across shards: ``cfx.optim.sharded``)."""
from __future__ import annotations

import functools
from typing import Any

import torch

from cfx._src.core import donation
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
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
    """``pmean`` of every floating leaf over ``axis`` as ONE flat all-reduce (bucketed DP sync)."""
    return _flat_reduce(tree, axis, mean=True)


def tree_psum(tree: Any, axis: str) -> Any:
    """``psum`` of every floating leaf over ``axis`` as ONE flat all-reduce."""
    return _flat_reduce(tree, axis, mean=False)


def _flat_reduce(tree: Any, axis: str, *, mean: bool) -> Any:
    items, treedef = tree_util.flatten(tree)
    floats = [i for i, x in enumerate(items) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floats:
        return tree
    dtype = functools.reduce(torch.promote_types, (items[i].dtype for i in floats), torch.float32)  # fp64 stays
    flat = torch.cat([items[i].reshape(-1).to(dtype) for i in floats])
    if flat.requires_grad:
        flat = (lax.pmean if mean else lax.psum)(flat, axis)
    else:  # the flat copy is ours: reduce and scale it in place (no second copy of the model)
        with donation.donated([flat]):
            flat = lax.psum(flat, axis)
        if mean:
            flat.div_(lax.axis_size(axis))
    out, offset = list(items), 0
    for i in floats:
        n = items[i].numel()
        out[i] = flat[offset:offset + n].view_as(items[i]).to(items[i].dtype)
        offset += n
    return tree_util.unflatten(treedef, out)
