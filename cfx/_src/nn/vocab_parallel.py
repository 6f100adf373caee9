"""Vocab-parallel embedding lookup and softmax cross-entropy (Megatron-LM).

The vocabulary is split into equal contiguous ranges over a mesh axis: rank ``i`` holds rows
``[i*V/n, (i+1)*V/n)`` of the embedding (and columns of the LM head). No rank ever holds the
full ``(B, T, V)`` logits; the loss combines per-rank pieces::

    m   = pmax(max_v l_local)                        (no gradient needed: any shift works)
    s   = psum(sum_v exp(l_local - m))
    t   = psum(l_local[target] if the target is in this rank's range else 0)
    loss = log(s) + m - t                            per token, then the mean over valid tokens
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cfx._src.lax import collectives as lax

IGNORE_INDEX = -100


def _range(v_local: int, axis: str) -> int:
    return lax.axis_index(axis) * v_local


def vocab_parallel_embed(w_local: torch.Tensor, tokens: torch.Tensor, axis: str) -> torch.Tensor:
    """Rows of the full embedding for ``tokens`` (B, T) from this rank's shard (V/n, C): (B, T, C)."""
    v_local = w_local.shape[0]
    local = tokens - _range(v_local, axis)
    mine = (local >= 0) & (local < v_local)
    e = F.embedding(local.clamp(0, v_local - 1), w_local) * mine[..., None].to(w_local.dtype)
    return lax.psum(e, axis)


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, axis: str) -> torch.Tensor:
    """Mean token cross-entropy (fp32) from this rank's logits shard (B, T, V/n); -100 ignored."""
    l = logits_local.float()
    v_local = l.shape[-1]
    m = lax.pmax(l.detach().amax(dim=-1), axis)  # (B, T)
    s = lax.psum(torch.exp(l - m[..., None]).sum(dim=-1), axis)  # (B, T)
    valid = targets != IGNORE_INDEX
    local = targets - _range(v_local, axis)
    mine = (local >= 0) & (local < v_local) & valid
    picked = l.gather(-1, local.clamp(0, v_local - 1)[..., None])[..., 0] * mine
    t = lax.psum(picked, axis)  # (B, T)
    per_token = (torch.log(s) + m - t) * valid
    return per_token.sum() / valid.sum().clamp_min(1)
