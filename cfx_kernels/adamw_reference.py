"""Plain-PyTorch AdamW step over flat buffers: ``torch.optim.AdamW``'s single-tensor path."""
from __future__ import annotations

import torch

__all__ = ["adamw_flat_reference_"]


def adamw_flat_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, *, step: int, lr: float, b1: float, b2: float,
                          eps: float, weight_decay: float) -> torch.Tensor:
    """One AdamW step in place on ``param``, ``exp_avg``, ``exp_avg_sq``; returns ``param``."""
    grad = grad.to(param.dtype)
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    step_size = lr / (1.0 - b1 ** step)
    denom = (exp_avg_sq.sqrt() / (1.0 - b2 ** step) ** 0.5).add_(eps)
    return param.addcdiv_(exp_avg, denom, value=-step_size)
