"""Expert parallelism: a mixture of experts' experts split over a mesh axis.

``expert_parallel(model, axis="expert")`` returns the model with every MoE block's experts on
``axis``: inside ``shard_map`` each rank holds ``E / n`` experts (split their ``"experts"``
logical axis with ``EXPERT_RULES`` or ``Rules({"experts": axis})``) and its own share of the
tokens (the batch is split over ``axis`` too, as the peers fold the expert axis into data
parallelism). Each MoE layer sends every (token, expert) row to its expert's rank with one
``cfx.lax.ragged_all_to_all`` (the sizes exchanged first), computes there, and sends the results
back the same way; the backward is the transposed exchange. The router is replicated, and the
routers' statistics are summed over the axes the batch is split over (``stats_axes``: ``axis``,
and ``data`` where the rows are split over it as well), so the load-balancing loss is the whole
batch's. An MoE with a ``capacity_factor`` must name its groups (``MoE(group_size=...)``,
``MixtralConfig(capacity_group_size=...)``) to run on a split batch: then each rank's capacity is
that of its own whole groups, and what is dropped is what one device with the same group size
drops (``check_capacity_groups``; without groups a split would silently change it).

``tensor_parallel_experts(model, axis="model")`` splits it Megatron's way as well (inside the experts:
each expert's hidden units over ``axis``; the attention heads and the vocabulary as
``tensor_parallel`` splits them), composing with the expert axis: ``expert=2,model=2``.

Gradients taken on each rank of its own rows' loss (a ``Plan``'s) become the gradient of the mean
over ranks with ``expert_grads``: the leaves ``axis`` replicates are averaged over it; the
experts' own, split over it, already hold every rank's rows (the exchange's transpose summed
them) and are divided by its size.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.spec import P, is_spec
from cfx._src.nn.vocab import vocab_parallel_layers
from cfx._src.parallel.megatron import TensorParallelBlock
from cfx._src.parallel.state import tree_pmean

EXPERT_RULES = {"experts": "expert"}


def has_experts(model: Any) -> bool:
    """Whether ``model`` has mixture-of-experts blocks (``TransformerBlock(moe=...)``)."""
    return any(getattr(b, "moe", None) is not None for b in getattr(model, "blocks", None) or ())


def check_capacity_groups(model: Any, split: str) -> None:
    """ValueError if a capacity-mode MoE block of ``model`` has no ``group_size`` while the batch's rows are
    split (``split`` says how, for the message): each part would apply the capacity to its own tokens."""
    for i, b in enumerate(getattr(model, "blocks", None) or ()):
        moe = getattr(b, "moe", None)
        if moe is not None and moe.capacity_factor is not None and moe.group_size is None:
            raise ValueError(f"{type(model).__name__}: block {i}'s MoE(capacity_factor={moe.capacity_factor}) has no "
                             f"group_size, and {split} splits the batch's rows, so each part would apply the "
                             "capacity to its own tokens and drop other rows than one device does. Set the groups "
                             "explicitly (MixtralConfig(capacity_group_size=S), MoE(group_size=S): S tokens per "
                             "group, dividing each rank's tokens), or drop capacity_factor (dropless).")


def expert_parallel(model: Any, axis: str | None = "expert", *, stats_axes: tuple[str, ...] | None = None) -> Any:
    """``model`` with its MoE blocks' experts split over ``axis`` (module doc; None: experts whole)
    and its routers' statistics summed over ``stats_axes`` (default ``(axis,)``): every mesh axis
    the batch's rows are split over."""
    name = type(model).__name__
    if not has_experts(model):
        raise ValueError(f"expert_parallel: {name} has no mixture-of-experts blocks "
                         "(TransformerBlock(moe=...)); use it with cfx.models.mixtral or a model built on MoE.")
    stats_axes = ((axis,) if axis else ()) if stats_axes is None else tuple(stats_axes)
    if stats_axes and not hasattr(model, "stats_axes"):
        raise ValueError(f"expert_parallel: {name} splits its batch over {stats_axes}, but has no `stats_axes` "
                         "field to sum its routers' statistics over them (as cfx.models.Mixtral has): its "
                         "load-balancing loss would be each rank's own. Add the field, or train it on one device.")
    if stats_axes or axis:
        check_capacity_groups(model, f"expert_parallel over {tuple(stats_axes) or (axis,)}")
    if axis is not None:
        model = model.map_blocks(lambda b: b if b.moe is None else dataclasses.replace(
            b, moe=dataclasses.replace(b.moe, expert_axis=axis)))
    return dataclasses.replace(model, stats_axes=stats_axes) if hasattr(model, "stats_axes") else model


def expert_grads(grads: Any, specs: Any, axis: str) -> Any:
    """Each rank's gradients of its own rows' mean loss made the gradients of the mean over ``axis``'s
    ranks (module doc): ``specs`` (the params' specs, a pytree of ``P`` like ``grads``) say which leaves
    ``axis`` splits. One flat all-reduce of the others."""
    items, treedef = tree_util.flatten(grads)
    spec_items = tree_util.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    assert len(spec_items) == len(items) and all(is_spec(s) for s in spec_items), (len(spec_items), len(items))
    shared = [i for i, s in enumerate(spec_items) if axis not in s.all_axes()]
    for i, g in zip(shared, tree_pmean([items[i] for i in shared], axis)):
        items[i] = g
    n = lax.axis_size(axis)
    for i, s in enumerate(spec_items):
        if axis in s.all_axes():
            items[i] = items[i] / n
    return tree_util.unflatten(treedef, items)


class TensorParallelMoEBlock(TensorParallelBlock):
    """A pre-norm ``TransformerBlock(moe=...)`` Megatron-split over ``axis``: its attention as
    ``TensorParallelBlock``'s, its experts' hidden units split inside ``MoE(model_axis=axis)``."""

    def apply(self, params: dict, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.apply_with_stats(params, x, **kwargs)[0]

    def apply_with_stats(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                         positions: torch.Tensor | None = None, key: torch.Tensor | None = None,
                         cache=None, stats_group_size: int | None = None) -> tuple[torch.Tensor, Any]:
        del key  # (no dropout: checked when the block is split)
        # x (B, T, C) replicated over the axis -> (B, T, C) replicated, and the router's statistics
        layers = self._local_layers(lax.axis_size(self.axis))
        h = self._f(layers["norm1"].apply(params["norm1"], x))
        h = layers["attn"].heads(params["attn"], h, mask=mask, positions=positions, cache=cache)  # (B, T, H/n * D)
        x = x + self._g(h, params["attn"]["o"])
        y, stats = layers["mlp"].apply_with_stats(params["mlp"], layers["norm2"].apply(params["norm2"], x),
                                                  stats_group_size=stats_group_size)
        return x + y, stats


def tensor_parallel_experts(model: Any, axis: str = "model") -> Any:
    """``model`` (a mixture of experts, e.g. ``cfx.models.mixtral``, its experts possibly split over an
    expert axis already) with its attention heads, each expert's hidden units and its vocabulary split
    over ``axis`` (module doc); rules must map ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` to ``axis``
    (``MEGATRON_RULES``)."""
    def split(b):
        if b.moe is None:
            return TensorParallelBlock(b, axis)
        if b.dropout or b.post_norm or b.seq is not None:
            raise ValueError("tensor_parallel_experts: a mixture-of-experts block with dropout, post-norm or a "
                             "sequence split does not split over a model axis yet; build it without them.")
        return TensorParallelMoEBlock(dataclasses.replace(b, moe=dataclasses.replace(b.moe, model_axis=axis)), axis)
    if not has_experts(model):
        raise ValueError(f"tensor_parallel_experts: {type(model).__name__} has no mixture-of-experts blocks; "
                         "use cfx.parallel.tensor_parallel.")
    return model.map_blocks(split).with_layers(**vocab_parallel_layers(model.sublayers(), axis))
