"""Plain-PyTorch LayerNorm and RMSNorm: what CPU users get, and what the Triton kernels must match."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["add_norm_reference", "layer_norm_reference", "rms_norm_reference"]


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (``F.layer_norm``), computed
    in fp32 (fp64 for fp64 ``x``) and returned in ``x.dtype``: the kernel's contract, and what CPU's
    mixed-dtype layer norm does; CUDA's refuses a bf16 ``x`` with fp32 params, so the reference promotes
    itself."""
    if (weight is None or weight.dtype == x.dtype) and (bias is None or bias.dtype == x.dtype):  # one dtype: fp32 inside
        return torch.layer_norm(x, (x.shape[-1],), weight, bias, eps)  # (F.layer_norm's op, without its Python)
    dt = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
    w = None if weight is None else weight.to(dt)
    b = None if bias is None else bias.to(dt)
    return F.layer_norm(x.to(dt), (x.shape[-1],), w, b, eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: the statistic in fp32, the normalised ``x`` rounded back to ``x.dtype``
    before the scale, so the result has ``promote(weight.dtype, x.dtype)``."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_norm_reference(x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (in x's dtype) and ``norm(s)``: the fused kernels' contract."""
    s = x + residual
    return s, norm(s)
