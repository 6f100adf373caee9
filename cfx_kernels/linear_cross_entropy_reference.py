"""Plain-PyTorch linear + cross-entropy, unfused: the ``(N, V)`` logits exist whole (see
``linear_cross_entropy``, which never holds them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy_reference"]


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                   bias: torch.Tensor | None = None, ignore_index: int = -100,
                                   label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets)``: hidden ``(..., C)``, weight ``(V, C)``,
    targets ``(...)``; the logits come out of the matmul in the inputs' dtype and are upcast to fp32
    (fp64 stays fp64) before the loss."""
    z = F.linear(hidden, weight, bias)  # (..., V)
    z = z.to(torch.promote_types(z.dtype, torch.float32)).reshape(-1, weight.shape[0])  # (N, V)
    loss = F.cross_entropy(z, targets.reshape(-1).long(), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss
