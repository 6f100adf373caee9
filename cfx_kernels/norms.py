"""Fused LayerNorm and RMSNorm over the last dim: one Triton program per row forward, and a
backward that writes ``dx`` row by row while each program accumulates its rows' ``dweight`` /
``dbias`` partials in registers (summed over programs on the host: one small reduction).

``layer_norm(x, weight, bias, eps=, impl=)`` and ``rms_norm(x, weight, eps=, impl=)``;
``impl="auto"`` runs Triton on CUDA tensors and the plain-PyTorch reference
(``norms_reference``) elsewhere. Statistics are fp32 whatever ``x``'s dtype; RMSNorm keeps HF
Llama's rounding (normalised ``x`` rounded to ``x.dtype`` before the scale).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cfx_kernels._common import resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.norms_reference import add_norm_reference, layer_norm_reference, rms_norm_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_FEATURES = 65536  # one row lives in one program's registers

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]


def _check(where: str, x, weight, bias) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        got = f"dtype {x.dtype}, shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: x must be a floating-point tensor (..., N), got {got}.")
    N = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (N,) or not t.is_floating_point():
            got = (f"dtype {t.dtype}, shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{where}: {name} must be a floating-point tensor of shape (N,) = "
                             f"({N},) matching x's last dim, got {got}.")


def _check_triton(where: str, x, weight, bias) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in DTYPES:
            raise ValueError(f"{where}: {name} has dtype {t.dtype}; the Triton kernel takes "
                             f"{[str(d) for d in DTYPES]} (use impl='reference' for others).")
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device} but x is on {x.device}.")
    if x.shape[-1] > MAX_FEATURES:
        raise ValueError(f"{where}: x has {x.shape[-1]} features; the Triton kernel takes at most "
                         f"{MAX_FEATURES} (use impl='reference').")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               eps: float = 1e-5, impl: str = "auto") -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, in ``x.dtype``."""
    _check("layer_norm", x, weight, bias)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if resolve_impl(impl, *tensors) == "reference" or x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps)
    _check_triton("layer_norm", x, weight, bias)
    return _Norm.apply(x, weight, bias, float(eps), False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
             impl: str = "auto") -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps)).to(x.dtype)`` over the last dim (HF Llama)."""
    _check("rms_norm", x, weight, None)
    if resolve_impl(impl, x, weight) == "reference" or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    _check_triton("rms_norm", x, weight, None)
    return _Norm.apply(x, weight, None, float(eps), True)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None, *, eps: float = 1e-5,
                   impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``layer_norm(s)``, both in ``x.dtype``: a pre-norm block's residual
    add and the next norm in one pass over the rows (and one in backward)."""
    _check_add("add_layer_norm", x, residual)
    _check("add_layer_norm", x, weight, bias)
    tensors = (x, residual, weight) if bias is None else (x, residual, weight, bias)
    if resolve_impl(impl, *tensors) == "reference" or x.numel() == 0:
        return add_norm_reference(x, residual, lambda s: layer_norm_reference(s, weight, bias, eps))
    _check_triton("add_layer_norm", x, weight, bias)
    return _AddNorm.apply(x, residual, weight, bias, float(eps), False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``rms_norm(s)`` in one pass (see ``add_layer_norm``)."""
    _check_add("add_rms_norm", x, residual)
    _check("add_rms_norm", x, weight, None)
    if resolve_impl(impl, x, residual, weight) == "reference" or x.numel() == 0:
        return add_norm_reference(x, residual, lambda s: rms_norm_reference(s, weight, eps))
    _check_triton("add_rms_norm", x, weight, None)
    return _AddNorm.apply(x, residual, weight, None, float(eps), True)


def _check_add(where: str, x, residual) -> None:
    if not isinstance(residual, torch.Tensor) or not isinstance(x, torch.Tensor) or residual.shape != x.shape \
            or residual.dtype != x.dtype:
        got = (f"{tuple(residual.shape)} {residual.dtype}" if isinstance(residual, torch.Tensor)
               else type(residual).__name__)
        want = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else "x's"
        raise ValueError(f"{where}: residual must have x's shape and dtype ({want}), got {got}; cast or "
                         "broadcast it first.")


# ---------------------------------------------------------------------------------------------
# Triton kernels. X/DY/DX are (M, N) with unit stride along N; Mean/Rstd are (M,) fp32.

@lazy_jit
def _norm_fwd_kernel(X, R, S, W, B, Y, Mean, Rstd, stride_x, stride_r, stride_s, stride_y, N, eps,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # s = x + r, rounded to x's dtype as the unfused add would, is what gets normalised
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        # HF rounding: the normalised x goes back to x's dtype before the scale
        y = (x * rstd).to(X.dtype.element_ty).to(tl.float32) * w
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@lazy_jit
def _norm_bwd_kernel(X, W, DY, DS, DX, DW, DB, Mean, Rstd, stride_x, stride_dy, stride_ds, stride_dx, M, N,
                     rows_per_program, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DS: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 row offsets: M * N may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if RMS:
            xhat = x * rstd
            # autograd of w * xhat.to(x.dtype): the grad reaching xhat is rounded to x's dtype
            g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
            dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
            c1 = tl.sum(g * xhat, axis=0) / N
            dx = (g - xhat * c1) * rstd
        else:
            mean = tl.load(Mean + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy * w
            dw += dy * xhat
            db += dy
            c1 = tl.sum(g * xhat, axis=0) / N
            c2 = tl.sum(g, axis=0) / N
            dx = (g - (xhat * c1 + c2)) * rstd
        if HAS_DS:  # the fused residual add: the sum's own gradient joins the norm's
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # (M, N)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _forward(x, weight, bias, eps, rms, residual=None):
    """The normalised rows; with ``residual``, of ``s = x + residual``, also returned (else None)."""
    x2 = _rows(x)  # (M, N)
    M, N = x2.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if rms else x.dtype
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    r2 = x2 if residual is None else _rows(residual)
    s = x2 if residual is None else torch.empty_like(x2, memory_format=torch.contiguous_format)
    BLOCK = triton.next_power_of_2(N)
    _norm_fwd_kernel[(M,)](x2, r2, s, weight, bias if bias is not None else weight, y, mean, rstd,
                           x2.stride(0), r2.stride(0), s.stride(0), y.stride(0), N, eps, RMS=rms,
                           HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=BLOCK,
                           num_warps=_warps(BLOCK))
    return (x2 if residual is None else s), y.view(*x.shape[:-1], N), mean, rstd


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)  # about 8 fp32 values of a row per thread


def _programs(x: torch.Tensor, M: int) -> int:
    if x.is_cuda:
        return min(M, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    return min(M, 4)  # the interpreter runs programs one after another


def _backward(ctx, dy, rms, ds=None):
    """dx (with ``ds``, the fused add's sum gradient, added: the gradient of x and of the residual),
    dweight, dbias."""
    x2, weight, bias, mean, rstd = ctx.saved_tensors
    M, N = x2.shape
    dy2 = _rows(dy)
    ds2 = dy2 if ds is None else _rows(ds)
    dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    G = _programs(x2, M)
    dw = torch.empty((G, N), dtype=torch.float32, device=x2.device)
    db = torch.empty((G, N), dtype=torch.float32, device=x2.device) if bias is not None else dw
    BLOCK = triton.next_power_of_2(N)
    _norm_bwd_kernel[(G,)](x2, weight, dy2, ds2, dx, dw, db, mean, rstd, x2.stride(0), dy2.stride(0),
                           ds2.stride(0), dx.stride(0), M, N, triton.cdiv(M, G), RMS=rms,
                           HAS_BIAS=bias is not None, HAS_DS=ds is not None, BLOCK=BLOCK,
                           num_warps=_warps(BLOCK))
    dweight = dw.sum(0).to(weight.dtype)
    dbias = db.sum(0).to(bias.dtype) if bias is not None else None
    return dx.view(ctx.x_shape), dweight, dbias


class _Norm(torch.autograd.Function):
    """LayerNorm, or RMSNorm with ``rms`` (its ``bias`` None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        x2, y, mean, rstd = _forward(x, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.x_shape, ctx.rms = x.shape, rms
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dweight, dbias = _backward(ctx, dy, ctx.rms)  # dbias None without a bias
        return dx, dweight, dbias, None, None


class _AddNorm(torch.autograd.Function):
    """``s = x + residual`` and ``norm(s)`` in one pass; backward, one pass for both gradients."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        s, y, mean, rstd = _forward(x, weight, bias, eps, rms, residual=residual)
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.x_shape, ctx.rms = x.shape, rms
        return s.view(x.shape), y

    @staticmethod
    def backward(ctx, ds, dy):
        if dy is None:  # only the sum was used
            return ds, ds, None, None, None, None
        dx, dweight, dbias = _backward(ctx, dy, ctx.rms, ds=ds)  # ds None: only the norm was used
        return dx, dx, dweight, dbias, None, None
