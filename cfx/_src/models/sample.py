"""Sampling text from a byte-level language model (no KV cache: the demo's contexts are short)."""
from __future__ import annotations

import torch

from cfx._src.core import random as jr


@torch.no_grad()
def sample_bytes(model, params, prompt: bytes, *, steps: int, key: torch.Tensor, context: int,
                 temperature: float = 0.8, logits=None) -> bytes:
    """``prompt`` continued by ``steps`` bytes drawn from ``softmax(logits / temperature)``;
    ``logits(params, tokens)`` defaults to ``model.apply``."""
    logits = logits or model.apply
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    tokens = torch.tensor(list(prompt) or [10], dtype=torch.int64)[None]  # (1, T)
    for i in range(steps):
        last = logits(params, tokens[:, -context:])[0, -1].float()  # (V,)
        nxt = jr.categorical(jr.fold_in(key, i), last / temperature)
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return bytes(tokens[0].tolist())
