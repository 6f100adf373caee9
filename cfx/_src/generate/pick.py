"""Picking the next token from a language model's logits: the one rule every decoder here uses
(``cfx.generate`` with its KV cache, ``sample_bytes`` without one).

Greedy decoding (``temperature=0``) picks the argmax; otherwise the logits are divided by
``temperature``, cut to the ``top_k`` largest and to the smallest set whose probability reaches
``top_p``, and sampled with ``cfx.random``: step ``i`` draws with ``fold_in(key, i)``, so the same
key gives the same tokens on every rank. A vocabulary-parallel model's logits (``logits_axis``,
``cfx.parallel.tensor_parallel``) are gathered before picking.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random as jr
from cfx._src.lax import collectives as lax
from cfx._src.models.parts import hook


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each step's token is picked (module doc)."""

    temperature: float = 0.0          # 0: greedy
    top_k: int | None = None          # keep the k largest logits
    top_p: float | None = None        # keep the smallest set whose probability reaches p
    key: torch.Tensor | None = None   # cfx.random key; step i draws with fold_in(key, i)

    def check(self, where: str) -> None:
        """ValueError naming ``where`` and the fix for settings that cannot sample."""
        if self.temperature < 0:
            raise ValueError(f"{where}: temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.temperature > 0 and self.key is None:
            raise ValueError(f"{where}: sampling (temperature={self.temperature}) needs key=cfx.random.key(seed).")
        if self.top_k is not None and self.top_k < 1 or self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"{where}: top_k must be >= 1 and top_p in (0, 1], got top_k={self.top_k}, "
                             f"top_p={self.top_p}.")

    def pick(self, model: Any, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Step ``step``'s tokens ``(B,)`` from ``model``'s last-position logits ``(B, V)`` (or this
        rank's ``(B, V/n)`` of a vocabulary-parallel model)."""
        logits = whole_vocab(model, logits)
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            order = logits.argsort(-1, descending=True)
            probs = logits.gather(-1, order).softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # beyond the smallest prefix reaching top_p
            logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(drop, float("-inf")))
        return jr.categorical(jr.fold_in(self.key, step), logits)


def whole_vocab(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole vocabulary (fp32): a vocabulary-parallel model's shards gathered."""
    axis = hook(model, "logits_axis")
    if axis is not None:
        logits = lax.all_gather(logits, axis, dim=-1, tiled=True)
    return logits.float()
