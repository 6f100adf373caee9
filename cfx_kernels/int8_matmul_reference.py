"""Plain-PyTorch int8 weight-only matmul and the symmetric absmax weight quantizer."""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: int8 values in [-127, 127]


def quantize_weight_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``w ~= q * scale``: ``w`` is ``(in, out)``, ``scale`` fp32 ``(out,)``
    is each column's ``absmax / 127`` (1 for an all-zero column), ``q`` int8 ``(in, out)``."""
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=0)  # (out,)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w32 / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul_reference(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``(x @ w_int8) * scale + bias`` in ``x.dtype``; the per-column scale is applied to the
    ``(N, out)`` product rather than to the ``(in, out)`` weight."""
    K, N = w_int8.shape
    y = torch.mm(x.reshape(-1, K), w_int8.to(x.dtype)).float()  # (M, out), a fresh tensor
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).view(*x.shape[:-1], N)
