"""Softmax of ``x + bias`` under a boolean mask in one pass: the Evoformer's attention weights
(AlphaFold 2 / FastFold: logits + pair bias + MSA mask), forward and backward in Triton.

``fused_softmax(x, bias=None, mask=None, *, impl="auto")`` computes, in fp32::

    z = x + bias                      # bias broadcast to x: x (B, S, H, R, R), bias (B, 1, H, R, R)
    z = z.masked_fill(~mask, -1e9)    # mask: bool, broadcast to x, True = attend
    y = softmax(z, dim=-1)            # returned in x.dtype

Masked positions are *set* to -1e9 (not offset by it), so a fully masked row attends uniformly
(1/L each), as AlphaFold's additive ``1e9 * (mask - 1)`` makes it do; and as a masked logit is a
constant, its gradient w.r.t. ``x`` and ``bias`` is exactly 0, fully masked rows included.
Gradients flow to ``x`` and ``bias``, never to ``mask``. The meaning is
:func:`cfx_kernels.fused_softmax_reference.fused_softmax_reference`'s, which ``impl="auto"`` runs
off CUDA (and on CUDA for inputs the kernel does not take).

The forward kernel reads each row of ``x`` once and ``bias`` / ``mask`` through their broadcast
strides (stride 0 along the dims they are broadcast over), so a pair bias shared by the S MSA
rows is never materialised at x's size; it writes ``y`` and saves nothing else (plus the mask).
The backward kernel writes ``dx = y * (dy - sum(dy * y, -1))``, 0 where masked; ``bias``'s
gradient is ``dx`` summed on the host over the dims ``bias`` was broadcast along. A program
takes a block of rows (one row when L is long). Leading dims are coalesced where x, bias and
mask allow; the kernel splits a row index over at most 4 of them.
"""
from __future__ import annotations


import torch

from cfx_kernels._common import on_device, resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.fused_softmax_reference import MASKED_LOGIT, fused_softmax_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; resolve_impl never picks Triton then
    triton = tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_LENGTH = 16384  # one row lives in one program's registers
MAX_LEADING_DIMS = 4  # after coalescing: how many indices the kernels split a row index into
_TILE = 4096  # elements per program: rows of a short L are blocked together

__all__ = ["MAX_LEADING_DIMS", "MAX_LENGTH", "fused_softmax", "triton_unsupported"]


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    return len(shape) <= len(target) and all(
        n == 1 or n == m for n, m in zip(reversed(shape), reversed(target)))


def _check(x, bias, mask) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        got = (f"dtype {x.dtype}, shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
               else type(x).__name__)
        raise ValueError(f"fused_softmax: x must be a floating-point tensor (..., L), got {got}.")
    for name, t in (("bias", bias), ("mask", mask)):
        if t is None:
            continue
        if name == "bias" and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"fused_softmax: bias must be a floating-point tensor broadcastable "
                             f"to x {tuple(x.shape)}, got {got}.")
        if name == "mask" and not (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"fused_softmax: mask must be a bool tensor (True = attend) "
                             f"broadcastable to x {tuple(x.shape)}, got {got}; pass mask.bool() "
                             f"for a 0/1 mask, or add an additive mask to bias.")
        if not _broadcasts(t.shape, x.shape):
            raise ValueError(f"fused_softmax: {name} of shape {tuple(t.shape)} does not broadcast "
                             f"to x's shape {tuple(x.shape)}: aligned from the right, each of its "
                             f"dims must be 1 or equal x's (e.g. a pair bias (B, 1, H, R, R) for x "
                             f"(B, S, H, R, R)).")
        if t.device != x.device:
            raise ValueError(f"fused_softmax: {name} is on {t.device} but x is on {x.device}; "
                             f"move it with {name}.to(x.device).")


def _row_layout(shape: torch.Size, *tensors) -> tuple[list[int], list[list[int]]]:
    """How the kernels find each row of ``tensors`` (None or broadcastable to ``shape``).

    Rows are x's leading dims in row-major order (x is contiguous). Returns ``(sizes, strides)``:
    the sizes of the leading dims left after dropping size-1 dims and merging a dim into the next
    wherever every tensor allows it (stride[i] == stride[i + 1] * size[i + 1]); and per tensor,
    its strides along those dims followed by its stride along the last dim (0 where broadcast).
    """
    per_tensor = [torch.broadcast_to(t, shape).stride() if t is not None else (0,) * len(shape)
                  for t in tensors]
    dims: list[tuple[int, tuple[int, ...]]] = []  # (size, one stride per tensor)
    for i, n in enumerate(shape[:-1]):
        if n == 1:
            continue
        st = tuple(s[i] for s in per_tensor)
        if dims and all(outer == inner * n for outer, inner in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    sizes = [n for n, _ in dims]
    strides = [[st[k] for _, st in dims] + [s[-1]] for k, s in enumerate(per_tensor)]
    return sizes, strides


def triton_unsupported(x: torch.Tensor, bias, mask) -> str | None:
    """Why the Triton kernel cannot take these (already checked) inputs; None when it can."""
    if triton is None:
        return "the triton package is not installed"
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            return (f"{name} has dtype {t.dtype}; the Triton kernel takes "
                    f"{[str(d) for d in DTYPES]} (use impl='reference' for others)")
    if x.shape[-1] > MAX_LENGTH:
        return (f"x's last dim is {x.shape[-1]}; the Triton kernel takes at most {MAX_LENGTH} "
                f"(use impl='reference')")
    sizes, _ = _row_layout(x.shape, bias, mask)
    if len(sizes) > MAX_LEADING_DIMS:
        return (f"x {tuple(x.shape)} with bias {None if bias is None else tuple(bias.shape)} and "
                f"mask {None if mask is None else tuple(mask.shape)} leaves {len(sizes)} leading "
                f"dims that cannot be merged; the Triton kernel takes at most {MAX_LEADING_DIMS} "
                f"(merge dims with reshape, or use impl='reference')")
    return None


def fused_softmax(x: torch.Tensor, bias: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """``softmax((x + bias).masked_fill(~mask, -1e9), -1)`` in fp32, returned in ``x.dtype``.

    ``x`` ``(..., L)`` floating; ``bias`` floating and ``mask`` bool (True = attend), each None
    or broadcastable to ``x``. A fully masked row attends uniformly; masked positions get
    gradient 0; ``mask`` gets none. ``impl``: ``"triton"`` (CUDA tensors, or CPU under
    ``TRITON_INTERPRET=1``; float32/16/bf16 x and bias, L <= 16384), ``"reference"``
    (:func:`fused_softmax_reference`), or ``"auto"``: Triton when the tensors are on CUDA and the
    kernel takes them, else the reference.
    """
    _check(x, bias, mask)
    tensors = [t for t in (x, bias, mask) if t is not None]
    which = resolve_impl(impl, *tensors)
    reason = triton_unsupported(x, bias, mask) if which == "triton" else None
    if reason is not None and impl == "triton":
        raise ValueError(f"fused_softmax: {reason}.")
    if which == "reference" or reason is not None or x.numel() == 0:
        return fused_softmax_reference(x, bias, mask)
    return _FusedSoftmax.apply(x, bias, mask)


# ---------------------------------------------------------------------------------------------
# Triton kernels. X/Y/DY/DX are contiguous (n_rows, L); a program takes ROWS rows. A row index
# splits over the leading dims (D0, D1, D2, D3) (coalesced and left-padded with 1s, see
# _row_layout); Bias/Mask are read at sum(i_k * s_k) + col * s_l (strides 0 where broadcast).
# Mask is the bool mask viewed as uint8.

@lazy_jit
def _softmax_fwd_kernel(X, Bias, Mask, Y, n_rows, L, D1, D2, D3,
                        sb0, sb1, sb2, sb3, sbl, sm0, sm1, sm2, sm3, sml,
                        HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, MASKED: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) int64 offsets
    cols = tl.arange(0, BLOCK)
    col_ok = cols < L
    inside = (rows < n_rows)[:, None] & col_ok[None, :]  # (ROWS, BLOCK)
    i3, i2, i1, i0 = rows % D3, rows // D3 % D2, rows // D3 // D2 % D1, rows // D3 // D2 // D1
    offs = rows[:, None] * L + cols[None, :]
    z = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_row = i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3
        z += tl.load(Bias + b_row[:, None] + cols[None, :] * sbl, mask=inside,
                     other=0.0).to(tl.float32)
    if HAS_MASK:
        m_row = i0 * sm0 + i1 * sm1 + i2 * sm2 + i3 * sm3
        keep = tl.load(Mask + m_row[:, None] + cols[None, :] * sml, mask=inside, other=1)
        z = tl.where(keep != 0, z, MASKED)
    z = tl.where(col_ok[None, :], z, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


@lazy_jit
def _softmax_bwd_kernel(Y, DY, Mask, DX, n_rows, L, D1, D2, D3, sm0, sm1, sm2, sm3, sml,
                        HAS_MASK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) int64 offsets
    cols = tl.arange(0, BLOCK)
    inside = (rows < n_rows)[:, None] & (cols < L)[None, :]  # (ROWS, BLOCK)
    offs = rows[:, None] * L + cols[None, :]
    y = tl.load(Y + offs, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    if HAS_MASK:  # a masked logit is the constant -1e9: no gradient reaches x or bias there
        i3, i2, i1, i0 = rows % D3, rows // D3 % D2, rows // D3 // D2 % D1, rows // D3 // D2 // D1
        m_row = i0 * sm0 + i1 * sm1 + i2 * sm2 + i3 * sm3
        keep = tl.load(Mask + m_row[:, None] + cols[None, :] * sml, mask=inside, other=1)
        dx = tl.where(keep != 0, dx, 0.0)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=inside)


def _grid(shape: torch.Size, *tensors) -> tuple:
    """(grid, launch kwargs, (n_rows, L, D1, D2, D3), per-tensor 5 strides) for x's ``shape``."""
    L = shape[-1]
    n_rows = shape.numel() // L
    sizes, strides = _row_layout(shape, *tensors)
    pad = MAX_LEADING_DIMS - len(sizes)
    assert pad >= 0, "fused_softmax: triton_unsupported lets only <= 4 leading dims through"
    sizes = [1] * pad + sizes
    strides = [[0] * pad + s for s in strides]
    BLOCK = triton.next_power_of_2(L)
    ROWS = min(max(_TILE // BLOCK, 1), triton.next_power_of_2(n_rows))
    launch = dict(ROWS=ROWS, BLOCK=BLOCK, num_warps=min(max(ROWS * BLOCK // 256, 1), 16))
    return (triton.cdiv(n_rows, ROWS),), launch, (n_rows, L, *sizes[1:]), strides


def _mask_arg(mask: torch.Tensor | None, shape: torch.Size, other: torch.Tensor) -> torch.Tensor:
    # the bool mask as the uint8 bytes it is, broadcast (a stride-0 view, never materialised)
    return other if mask is None else torch.broadcast_to(mask, shape).view(torch.uint8)


def _forward(x, bias, mask):
    x2 = x.contiguous()  # (..., L), rows in row-major order
    y = torch.empty_like(x2)
    grid, launch, dims, (sb, sm) = _grid(x.shape, bias, mask)
    b = x2 if bias is None else torch.broadcast_to(bias, x.shape)
    _softmax_fwd_kernel[grid](x2, b, _mask_arg(mask, x.shape, x2), y, *dims, *sb, *sm,
                              HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
                              MASKED=MASKED_LOGIT, **launch)
    return y


def _backward(y, dy, mask):
    dx = torch.empty_like(y)
    grid, launch, dims, (sm,) = _grid(y.shape, mask)
    _softmax_bwd_kernel[grid](y, dy, _mask_arg(mask, y.shape, y), dx, *dims, *sm,
                              HAS_MASK=mask is not None, **launch)
    return dx


def _sum_to(dx: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``dx`` summed (in fp32) over the dims a tensor of ``shape`` was broadcast along; a copy."""
    lead = dx.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, n in enumerate(shape)
                            if n == 1 and dx.shape[lead + i] != 1)]
    if not dims:
        return dx.to(dtype, copy=True)  # never dx itself: x and bias get separate gradients
    return dx.sum(dims, keepdim=True, dtype=torch.float32).reshape(shape).to(dtype)


class _FusedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, mask):
        with on_device(x):
            y = _forward(x, bias, mask)
        ctx.save_for_backward(y, mask)  # x and bias are not needed: dx comes from y alone
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, mask = ctx.saved_tensors
        with on_device(y):
            dx = _backward(y, dy.contiguous(), mask)
        dbias = _sum_to(dx, *ctx.bias_meta) if ctx.needs_input_grad[1] else None
        return (dx if ctx.needs_input_grad[0] else None), dbias, None
