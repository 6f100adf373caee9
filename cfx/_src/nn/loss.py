"""Token cross-entropy: over the whole vocabulary, over a vocabulary split across a mesh axis
(Megatron-LM), and the mean over a sequence split across a mesh axis.

The vocabulary is split into equal contiguous ranges over a mesh axis: rank ``i`` holds columns
``[i*V/n, (i+1)*V/n)`` of the logits. No rank ever holds the full ``(B, T, V)`` logits; the loss
combines per-rank pieces::

    m   = pmax(max_v l_local)                        (no gradient needed: any shift works)
    s   = psum(sum_v exp(l_local - m))
    t   = psum(l_local[target] if the target is in this rank's range else 0)
    loss = log(s) + m - t                            per token, then the mean over valid tokens
"""
from __future__ import annotations

import torch

from cfx._src.lax import collectives as lax
from cfx_kernels.cross_entropy import cross_entropy as _cross_entropy

IGNORE_INDEX = -100  # a target position that counts for nothing (Hugging Face's convention)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (fp64 for fp64 logits); logits ``(B, T, V)``, targets ``(B, T)``,
    -100 ignored.

    On CUDA the fused kernel (``cfx_kernels.cross_entropy``) never holds fp32 ``(B, T, V)``
    probabilities; elsewhere this is ``F.cross_entropy(logits.float(), ...)``."""
    return _cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def vocab_range_start(v_local: int, axis: str) -> torch.Tensor:
    """The first vocabulary id this rank's shard of ``v_local`` ids holds."""
    return lax.axis_index(axis) * v_local


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, axis: str) -> torch.Tensor:
    """Mean token cross-entropy (fp32, fp64 for fp64 logits) from this rank's logits shard (B, T, V/n);
    -100 ignored."""
    l = logits_local.to(torch.promote_types(logits_local.dtype, torch.float32))
    v_local = l.shape[-1]
    m = lax.pmax(l.detach().amax(dim=-1), axis)  # (B, T)
    s = lax.psum(torch.exp(l - m[..., None]).sum(dim=-1), axis)  # (B, T)
    valid = targets != IGNORE_INDEX
    local = targets - vocab_range_start(v_local, axis)
    mine = (local >= 0) & (local < v_local) & valid
    picked = torch.where(mine, l.gather(-1, local.clamp(0, v_local - 1)[..., None])[..., 0], 0.0)
    t = lax.psum(picked, axis)  # (B, T)
    per_token = (torch.log(s) + m - t) * valid
    return per_token.sum() / valid.sum().clamp_min(1)


def mean_over_sequence(local_mean: torch.Tensor, count: torch.Tensor, axis: str) -> torch.Tensor:
    """The mean over every rank's tokens from this rank's mean over its ``count`` tokens."""
    total = lax.psum(torch.stack([local_mean * count, count.to(local_mean.dtype)]), axis)
    return total[0] / total[1]
