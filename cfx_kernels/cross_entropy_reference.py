"""Plain-PyTorch softmax cross-entropy and its vocab-shard pieces (see ``cross_entropy``)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["CrossEntropyStats", "cross_entropy_reference", "shard_grad_reference", "stats_reference"]


class CrossEntropyStats(NamedTuple):
    """Per-row pieces of the loss over one vocab shard, fp32 (fp64 for fp64 logits, in the
    reference) with the rows' shape.

    ``max``: the shard's largest logit; ``sum_exp``: ``sum(exp(z - max))`` over the shard;
    ``target_logit``: the target's logit if the target lies in this shard, else 0;
    ``sum_logits``: the sum of the shard's logits (for label smoothing).
    """

    max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor
    sum_logits: torch.Tensor


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int,
                            label_smoothing: float, reduction: str) -> torch.Tensor:
    """``F.cross_entropy`` in fp32 (fp64 for fp64 logits) over logits ``(..., V)`` and targets ``(...)``."""
    V = logits.shape[-1]
    loss = F.cross_entropy(_at_least_fp32(logits).reshape(-1, V), targets.reshape(-1).long(),
                           ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """The logits in fp32, or in fp64 if they are fp64 (parity tests compute in fp64 throughout)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _local_targets(targets: torch.Tensor, vocab_start: int, V: int):
    t = targets.long() - vocab_start
    ok = (t >= 0) & (t < V)
    return t.clamp(0, V - 1), ok


def stats_reference(logits: torch.Tensor, targets: torch.Tensor, *,
                    vocab_start: int) -> CrossEntropyStats:
    z = _at_least_fp32(logits)  # (..., V)
    m = z.amax(-1)
    t, ok = _local_targets(targets, vocab_start, z.shape[-1])
    zt = z.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    return CrossEntropyStats(m, (z - m.unsqueeze(-1)).exp_().sum(-1),
                             torch.where(ok, zt, torch.zeros_like(zt)), z.sum(-1))


def shard_grad_reference(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                         grad_rows: torch.Tensor, *, vocab_start: int, vocab_size: int,
                         label_smoothing: float) -> torch.Tensor:
    z = _at_least_fp32(logits)  # (..., V)
    d = (z - lse.unsqueeze(-1)).exp_()  # softmax; in place from here on: one (..., V) buffer
    if label_smoothing:
        d -= label_smoothing / vocab_size
    t, ok = _local_targets(targets, vocab_start, z.shape[-1])
    # minus (1 - eps) at each owned target: the one-hot term, without an (..., V) one-hot tensor
    d.scatter_add_(-1, t.unsqueeze(-1), -(1.0 - label_smoothing) * ok.unsqueeze(-1).to(d.dtype))
    return d.mul_(grad_rows.unsqueeze(-1)).to(logits.dtype)
