"""Plain-PyTorch softmax of ``x + bias`` under a boolean mask: what CPU users get, and what the
Triton kernel (``fused_softmax``) must match.

``x`` is ``(..., L)`` logits; ``bias`` (or None) a floating tensor and ``mask`` (or None) a bool
tensor (True = attend), each broadcastable to ``x``, e.g. x ``(B, S, H, R, R)`` (the Evoformer's
row attention logits), bias ``(B, 1, H, R, R)`` (the pair bias, shared by the S MSA rows), mask
``(B, S, 1, 1, R)``. The result is::

    softmax((x + bias).masked_fill(~mask, -1e9), dim=-1)

computed in fp32 (fp64 stays fp64) and returned in ``x.dtype``. Masked positions are *set* to
-1e9 before the softmax, not offset by it: a fully masked row therefore attends uniformly (1/L
each), as AlphaFold's additive ``1e9 * (mask - 1)`` bias makes it do. A masked position's logit
is the constant -1e9, so its gradient w.r.t. ``x`` and ``bias`` is exactly 0 (in fully masked
rows too). Gradients flow to ``x`` and ``bias``, never to ``mask``.
"""
from __future__ import annotations

import torch

MASKED_LOGIT = -1e9  # what a masked-out position's logit is set to before the softmax

__all__ = ["MASKED_LOGIT", "fused_softmax_reference"]


def fused_softmax_reference(x: torch.Tensor, bias: torch.Tensor | None = None,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax((x + bias).masked_fill(~mask, -1e9), -1)`` in fp32, in ``x.dtype`` (inputs as
    checked by :func:`cfx_kernels.fused_softmax.fused_softmax`)."""
    z = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., L)
    if bias is not None:
        z = z + bias.to(z.dtype)
    if mask is not None:
        z = z.masked_fill(~mask, MASKED_LOGIT)
    return torch.softmax(z, dim=-1).to(x.dtype)
