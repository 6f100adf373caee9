"""Sequence parallelism over ``seq``: each rank holds ``T/N`` positions of every sequence and
attention gathers the rest (``sp=ring``: keys and values round the ring, positions in zigzag order;
``sp=ulysses``: all-to-alls between a sequence and a head split); the gradients of what the split
replicates are summed over ``seq``. Megatron-SP (``sp=megatron``) is the model axis's
(``megatron.py``)."""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.mesh.spec import P
from cfx._src.models.parts import sequence_part
from cfx._src.parallel.sequence import SequenceSplit, sequence_grads, sequence_parallel
from cfx._src.plan.strategy import Built, Strategy, on_pieces


class Sequence(Strategy):
    name, axes = "seq", ("seq",)

    def check_plan(self, plan) -> None:
        if plan.has("seq") and plan.sp not in ("ring", "ulysses"):
            raise ValueError(f"Plan: the seq axis splits the sequence, which sp={plan.sp} does not; use sp=ring "
                             "(the default) or sp=ulysses, or drop seq= from the mesh.")
        if plan.sp in ("ring", "ulysses") and not plan.has("seq"):
            raise ValueError(f"Plan: sp={plan.sp} splits the sequence over a seq axis, and the mesh "
                             f"{dict(plan.mesh)} has none; add seq=N to the mesh.")

    def check(self, plan, model, where: str) -> None:
        if not plan.has("seq"):
            return
        if sequence_part(model) is None:
            raise ValueError(f"{where}: {type(model).__name__} cannot split its sequence (it has no \"sequence\" "
                             "sublayer, as GPT2, Llama and Bert do); drop seq= from the mesh.")
        if plan.sp == "ulysses":  # each rank's heads (after the model axis's split) divide over seq
            n = plan.size("seq")
            for i, block in enumerate(model.blocks):
                heads = getattr(block, "n_heads", None)
                per_rank = heads // plan.size("model") if heads else 0
                if per_rank % n:
                    raise ValueError(f"{where}: sp=ulysses splits the {per_rank} attention heads of each rank's "
                                     f"block {i} over seq={n}, which does not divide them; use sp=ring, or a seq "
                                     f"size dividing {per_rank}.")

    def parallelize(self, plan, model) -> Any:
        return sequence_parallel(model, "seq", method=plan.sp) if plan.has("seq") else model

    def reduce(self, plan, grads: Any, built: Built) -> Any:
        """Each rank's gradient covers its own positions: summed over ``seq`` (one flat all-reduce)."""
        return on_pieces(grads, lambda g: sequence_grads(g, P(), "seq")) if plan.has("seq") else grads

    def arrange(self, plan, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's zigzag order of the positions (a per-token mean loss does not depend on it)."""
        if plan.sp != "ring":
            return tokens, targets
        order = SequenceSplit("seq", "ring", "zigzag").order(tokens.shape[1], plan.size("seq"))
        return tokens[:, order], targets[:, order]
