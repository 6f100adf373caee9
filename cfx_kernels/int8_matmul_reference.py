"""Plain-PyTorch int8 weight-only matmul and the symmetric absmax weight quantizer.

``int8_matmul_reference`` converts the int8 weight to ``x``'s dtype for the product and drops that
copy: backward converts it again from the int8 weight it saved (``_Int8MatmulReference``), so a frozen
int8 base holds no floating copy of its weights between forward and backward.
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: int8 values in [-127, 127]

__all__ = ["int8_matmul_reference", "quantize_weight_reference"]


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
    ``(N, out)`` product rather than to the ``(in, out)`` weight. Gradients flow to ``x`` and
    ``bias`` (the weight and its scale are frozen)."""
    K, N = w_int8.shape
    y = _Int8MatmulReference.apply(x.reshape(-1, K), w_int8, scale, bias)  # (M, out)
    return y.view(*x.shape[:-1], N)


def _forward(x2: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(x2, w_int8.to(x2.dtype)).float()  # (M, out), a fresh tensor; the weight's copy dies here
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    return y.to(x2.dtype)


class _Int8MatmulReference(torch.autograd.Function):
    """``_forward`` saving the int8 weight (not its floating copy) for backward, where ``dx = (dy *
    scale) @ w.T`` converts it again: the ops autograd would run on the saved copy, in their order,
    so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, x2, w_int8, scale, bias):
        ctx.save_for_backward(w_int8, scale)
        ctx.has_bias = bias is not None
        return _forward(x2, w_int8, scale, bias)

    @staticmethod
    def backward(ctx, dy):
        w_int8, scale = ctx.saved_tensors
        dx = dbias = None
        dy32 = dy.float()  # (M, out)
        if ctx.needs_input_grad[0]:
            dx = torch.mm((dy32 * scale).to(dy.dtype), w_int8.to(dy.dtype).t())  # (M, in)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = dy32.sum(0)
        return dx, None, None, dbias
