"""Plain-PyTorch LayerNorm and RMSNorm: what CPU users get, and what the Triton kernels must match."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (``F.layer_norm``)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: the statistic in fp32, the normalised ``x`` rounded back to ``x.dtype``
    before the scale, so the result has ``promote(weight.dtype, x.dtype)``."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
