"""ZeRO-2 gradient buckets: reduce-scatter each group of gradients during backward.

Each group's leaves pass through ``_BucketScatter``, an identity in forward whose one
differentiable input is a *sink*: a zero shard (S,) per group. Autograd runs the node's backward
once every gradient of the group's leaves exists (right after the last layer using them); it
packs them into rows (n, S), reduce-scatters, and hands this rank's shard to the sink. So the
group's full gradient lives only inside that call, and ``value_and_grad`` returns the sinks'
gradients: ``ShardGrads``, one shard per group of the gradient averaged over the axis. Parameters without a
gradient contribute zeros; a group none of whose leaves is used is never reduced (on any rank)
and its shard is zero. Where the body tracks varying axes, the leaves are this rank's own copies
(typed as varying over the axis: no implicit pvary sums their gradients first) and a shard is
typed as ``psum_scatter`` types it: its group's leaves' axes and the ZeRO axis.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lax import vma
from cfx._src.transforms.autodiff import value_and_grad


class ShardGrads(NamedTuple):
    shards: tuple   # per group: this rank's shard of the gradient averaged over the ZeRO axis


class _BucketScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sink, info, *leaves):
        ctx.info = info
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in leaves)

    @staticmethod
    def backward(ctx, *grads):
        layout, dtype, axis = ctx.info
        rows = layout.rows_from_leaves(list(grads), dtype=dtype)   # (n, S); None -> zeros
        shard = lax.psum_scatter(rows, axis, dim=0, tiled=False)   # (S,) summed over the axis
        return (shard.div_(lax.axis_size(axis)), None) + (None,) * len(grads)


def bucketed_value_and_grad(fun: Callable[..., Any], layout, axis: str, params: Any, args: tuple,
                            kwargs: dict, *, has_aux: bool):
    """``(out, ShardGrads)`` for ``fun(params, *args, **kwargs)`` (see the module doc)."""
    leaves, treedef = tree_util.flatten(params)
    sinks = tuple(vma.declare_varying(torch.zeros(lay.size, dtype=dt),
                                      frozenset({axis}).union(*(vma.varying_axes(leaves[i]) for i in idx)))
                  for idx, lay, dt in layout.groups)

    def through_buckets(sinks, *args, **kwargs):
        new = [vma.declare_varying(x.detach(), (axis,)) for x in leaves]
        for (idx, lay, dt), sink in zip(layout.groups, sinks):
            outs = _BucketScatter.apply(sink, (lay, dt, axis), *[new[i] for i in idx])
            for i, o in zip(idx, outs):
                new[i] = o
        return fun(tree_util.unflatten(treedef, new), *args, **kwargs)

    out, grads = value_and_grad(through_buckets, has_aux=has_aux)(sinks, *args, **kwargs)
    return out, ShardGrads(tuple(grads))
