"""Expert parallelism: a mixture of experts' experts split over a mesh axis.

``expert_parallel(model, axis="expert")`` returns the model with every MoE block's experts on
``axis``: inside ``shard_map`` each rank holds ``E / n`` experts (split their ``"experts"``
logical axis with ``EXPERT_RULES`` or ``Rules({"experts": axis})``) and its own share of the
tokens (the batch is split over ``axis`` too, as the peers fold the expert axis into data
parallelism). Each MoE layer sends every (token, expert) row to its expert's rank with one
``cfx.lax.ragged_all_to_all`` (the sizes exchanged first), computes there, and sends the results
back the same way; the backward is the transposed exchange. The router is replicated, and the
routers' statistics are summed over the axis, so the load-balancing loss is the whole batch's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

EXPERT_RULES = {"experts": "expert"}


def expert_parallel(model: Any, axis: str = "expert") -> Any:
    """``model`` with its MoE blocks' experts split over ``axis`` (module doc)."""
    blocks = getattr(model, "blocks", None)
    if not blocks or not any(getattr(b, "moe", None) is not None for b in blocks):
        raise ValueError(f"expert_parallel: {type(model).__name__} has no mixture-of-experts blocks "
                         "(TransformerBlock(moe=...)); use it with cfx.models.mixtral or a model built on MoE.")
    return model.map_blocks(
        lambda b: b if b.moe is None else dataclasses.replace(b, moe=dataclasses.replace(b.moe, expert_axis=axis)))
