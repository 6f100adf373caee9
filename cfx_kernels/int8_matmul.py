"""int8 weight-only matmul with per-output-channel scales.

``int8_matmul(x, w_int8, scale, bias=None)`` computes ``x @ (w_int8 * scale) + bias`` for
``x`` ``(..., in)``, ``w_int8`` ``(in, out)`` (cfx's ``Linear`` layout, so the scales are per
column) and ``scale`` ``(out,)``. The Triton kernel reads the weight as int8 (a quarter of the
fp32 bytes), converts each tile to ``x``'s dtype in registers, accumulates in fp32 and applies
``scale`` and ``bias`` in the epilogue. ``quantize_weight(w)`` makes ``(w_int8, scale)``
(symmetric absmax per column). Gradients flow to ``x`` and ``bias`` (the int8 weight is frozen).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cfx_kernels._common import resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.int8_matmul_reference import int8_matmul_reference, quantize_weight_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["int8_matmul", "quantize_weight"]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_int8, scale)`` with ``w ~= w_int8 * scale``; ``w`` is a floating ``(in, out)`` matrix."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        got = f"dtype {w.dtype}, shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"quantize_weight: w must be a 2-D floating-point (in, out) matrix, got {got}.")
    return quantize_weight_reference(w)


def _check(x, w_int8, scale, bias) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        got = f"dtype {x.dtype}, shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"int8_matmul: x must be a floating-point tensor (..., in), got {got}.")
    if not isinstance(w_int8, torch.Tensor) or w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        got = (f"dtype {w_int8.dtype}, shape {tuple(w_int8.shape)}" if isinstance(w_int8, torch.Tensor)
               else type(w_int8).__name__)
        raise ValueError(f"int8_matmul: w_int8 must be a 2-D int8 (in, out) tensor, got {got}; make "
                         "it with quantize_weight.")
    K, N = w_int8.shape
    if x.shape[-1] != K:
        raise ValueError(f"int8_matmul: x has {x.shape[-1]} features in its last dim but w_int8 is "
                         f"{(K, N)} (in, out).")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (N,) or not t.is_floating_point():
            got = (f"dtype {t.dtype}, shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"int8_matmul: {name} must be a floating-point tensor of shape (out,) = "
                             f"({N},), got {got}.")


def int8_matmul(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """``x @ (w_int8 * scale) + bias`` in ``x.dtype``; x ``(..., in)`` -> ``(..., out)``."""
    _check(x, w_int8, scale, bias)
    tensors = (x, w_int8, scale) + (() if bias is None else (bias,))
    if resolve_impl(impl, *tensors) == "reference" or x.numel() == 0:
        return int8_matmul_reference(x, w_int8, scale, bias)
    for name, t in (("x", x), ("scale", scale), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"int8_matmul: {name} has dtype {t.dtype}; the Triton kernel takes "
                             f"{[str(d) for d in DTYPES]} (use impl='reference' for others).")
    for name, t in (("w_int8", w_int8), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"int8_matmul: {name} is on {t.device} but x is on {x.device}.")
    K, N = w_int8.shape
    y = _Int8Matmul.apply(x.reshape(-1, K), w_int8, scale, bias)  # (M, N)
    return y.view(*x.shape[:-1], N)


@lazy_jit
def _int8_mm_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # (BM, BK)
        w = tl.load(W + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0)  # (BK, BN) int8
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    s = tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    M, K = x2.shape
    N = w.shape[1]
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    BM = 16 if M <= 16 else 64
    BN, BK = 64, 64
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _int8_mm_kernel[grid](x2, w, scale, bias if bias is not None else scale, y, M, N, K,
                          x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0),
                          HAS_BIAS=bias is not None,
                          PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
                          BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return y


class _Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, scale, bias):
        ctx.save_for_backward(w, scale)
        ctx.has_bias = bias is not None
        return _launch(x2, w, scale, bias)

    @staticmethod
    def backward(ctx, dy):
        w, scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            # dx = (dy * scale) @ w.T, the weight converted tile by tile in the kernel: w.T is
            # (out, in) int8 with unit scales.
            dys = (dy.float() * scale.float()).to(dy.dtype)
            dx = _launch(dys, w.t(), torch.ones(w.shape[0], dtype=torch.float32, device=w.device),
                         None)
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, None, None, dbias
