"""Sampling text from a byte-level language model without a KV cache (the training job's demo:
its contexts are short): each step runs the model on the last ``context`` bytes and picks the next
byte as ``cfx.generate`` does (``pick.Sampling``, ``decode_steps``)."""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.generate.decode import decode_steps
from cfx._src.generate.pick import Sampling


@torch.no_grad()
def sample_bytes(model: Any, params: Any, prompt: bytes, *, steps: int, key: torch.Tensor, context: int,
                 temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None) -> bytes:
    """``prompt`` continued by ``steps`` bytes, each drawn from ``softmax(logits / temperature)``
    (cut by ``top_k`` / ``top_p``; 0 is greedy) with ``fold_in(key, i)`` at step ``i``. A
    vocabulary-parallel model's logits are gathered first, so under ``shard_map`` every rank
    samples the same bytes."""
    sampling = Sampling(temperature, top_k, top_p, key)
    sampling.check("sample_bytes")
    tokens = [torch.tensor(list(prompt) or [10], dtype=torch.int64)[None]]  # (1, T), then (1, 1) per step

    def last_logits() -> torch.Tensor:  # (1, V): the last position's, over the last context bytes
        return model.apply(params, torch.cat(tokens, dim=1)[:, -context:])[:, -1]

    def advance(tok: torch.Tensor, i: int) -> torch.Tensor:
        del i  # no cache: the window holds every position
        tokens.append(tok[:, None])
        return last_logits()
    new = decode_steps(model, last_logits(), advance, sampling, steps=steps) if steps > 0 else []
    return bytes(tokens[0][0].tolist() + [int(t) for t in new])
