"""Softmax cross-entropy over large vocabularies without fp32 probabilities.

``cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.0, reduction="mean")``
matches ``F.cross_entropy(logits.float(), ...)``. The Triton path streams each row's logits
once forward (an online max / sum-exp in fp32, plus the target's logit and the row sum for
smoothing) and saves only the row's log-sum-exp (``N`` floats); backward streams them again and
writes ``(softmax - smoothed one-hot) * grad`` straight in the logits' dtype. Nothing of size
``N x V`` is ever held in fp32.

Vocab parallel (the logits' last dim split over ranks, rank ``r`` holding columns
``[start_r, start_r + V_r)``)::

    st   = cross_entropy_stats(shard, targets, vocab_start=start_r)  # local, per row
    M    = pmax(st.max)
    lse  = M + log(psum(st.sum_exp * exp(st.max - M)))
    z_t  = psum(st.target_logit)          # only the target's owner contributes a nonzero
    sz   = psum(st.sum_logits)
    loss = loss_from_stats(lse, z_t, sz, targets, vocab_size=V, label_smoothing=eps)
    # loss_row = lse - (1 - eps) * z_t - eps * sz / V   (0 where targets == ignore_index)
    d_shard = cross_entropy_shard_grad(shard, targets, lse, dloss_row, vocab_start=start_r,
                                       vocab_size=V, label_smoothing=eps)

with ``dloss_row = 1 / n_valid`` on valid rows (0 on ignored ones) for a mean loss.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cfx_kernels._common import resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.cross_entropy_reference import (
    CrossEntropyStats,
    cross_entropy_reference,
    shard_grad_reference,
    stats_reference,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum", "none")
BLOCK_V = 1024

__all__ = ["DTYPES", "REDUCTIONS", "CrossEntropyStats", "cross_entropy", "cross_entropy_shard_grad",
           "cross_entropy_stats", "loss_from_stats"]


def _check(where: str, logits, targets) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        got = (f"dtype {logits.dtype}, shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"{where}: logits must be a floating-point tensor (..., V), got {got}.")
    if (not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex()
            or targets.dtype == torch.bool):
        got = f"dtype {targets.dtype}" if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"{where}: targets must be an integer tensor of class ids, got {got}.")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{where}: targets shape {tuple(targets.shape)} must equal logits' shape "
                         f"without its last (vocab) dim, {tuple(logits.shape[:-1])}.")


def _use_triton(where: str, impl: str, logits: torch.Tensor, targets: torch.Tensor) -> bool:
    if resolve_impl(impl, logits, targets) == "reference" or logits.numel() == 0:
        return False
    if logits.dtype not in DTYPES:
        raise ValueError(f"{where}: logits have dtype {logits.dtype}; the Triton kernel takes "
                         f"{[str(d) for d in DTYPES]} (use impl='reference' for others).")
    if targets.device != logits.device:
        raise ValueError(f"{where}: targets are on {targets.device} but logits on {logits.device}.")
    return True


def _check_smoothing(where: str, label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing must lie in [0, 1], got {label_smoothing!r}.")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean",
                  impl: str = "auto") -> torch.Tensor:
    """fp32 cross-entropy of logits ``(..., V)`` against integer targets ``(...)``.

    ``mean`` averages over the targets that are not ``ignore_index`` (NaN if there are none, as
    in PyTorch); ``none`` returns the per-row losses (0 on ignored rows) with ``targets``' shape.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    _check_smoothing("cross_entropy", label_smoothing)
    _check("cross_entropy", logits, targets)
    use_triton = _use_triton("cross_entropy", impl, logits, targets)
    if not use_triton:
        return cross_entropy_reference(logits, targets, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction)
    losses = _CrossEntropy.apply(_rows(logits), targets.reshape(-1), int(ignore_index),
                                 float(label_smoothing))  # (N,) fp32
    if reduction == "none":
        return losses.view(targets.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def cross_entropy_stats(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                        impl: str = "auto") -> CrossEntropyStats:
    """The per-row pieces of the loss over this shard of the vocab (columns ``vocab_start ...
    vocab_start + V_shard``); combine them across shards as in the module docstring."""
    _check("cross_entropy_stats", logits, targets)
    use_triton = _use_triton("cross_entropy_stats", impl, logits, targets)
    if not use_triton:
        return stats_reference(logits, targets, vocab_start=vocab_start)
    st = _stats(_rows(logits), targets.reshape(-1), vocab_start)
    return CrossEntropyStats(*(t.view(targets.shape) for t in st))


def loss_from_stats(lse: torch.Tensor, target_logit: torch.Tensor, sum_logits: torch.Tensor,
                    targets: torch.Tensor, *, vocab_size: int, ignore_index: int = -100,
                    label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-row losses from the combined (whole-vocab) pieces; 0 where ``targets == ignore_index``."""
    _check_smoothing("loss_from_stats", label_smoothing)
    loss = lse - (1.0 - label_smoothing) * target_logit - label_smoothing / vocab_size * sum_logits
    return torch.where(targets != ignore_index, loss, torch.zeros_like(loss))


def cross_entropy_shard_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                             grad_rows: torch.Tensor, *, vocab_start: int, vocab_size: int,
                             label_smoothing: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """``d loss / d logits`` for this shard, in the logits' dtype: ``(softmax - (1 - eps) *
    onehot - eps / V) * grad_rows``; ``lse`` is the whole-vocab log-sum-exp per row and
    ``grad_rows`` the loss's gradient per row (0 on ignored rows)."""
    _check_smoothing("cross_entropy_shard_grad", label_smoothing)
    _check("cross_entropy_shard_grad", logits, targets)
    use_triton = _use_triton("cross_entropy_shard_grad", impl, logits, targets)
    for name, t in (("lse", lse), ("grad_rows", grad_rows)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(targets.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cross_entropy_shard_grad: {name} must have targets' shape "
                             f"{tuple(targets.shape)}, got {got}.")
    if not use_triton:
        return shard_grad_reference(logits, targets, lse, grad_rows, vocab_start=vocab_start,
                                    vocab_size=vocab_size, label_smoothing=label_smoothing)
    d = _grad(_rows(logits), targets.reshape(-1), lse.reshape(-1).float(),
              grad_rows.reshape(-1).float(), vocab_start, vocab_size, label_smoothing)
    return d.view(logits.shape)


# ---------------------------------------------------------------------------------------------
# Triton kernels: one program per row, streaming the row in BLOCK-wide slices.

@lazy_jit
def _stats_kernel(Z, T, Max, SumExp, Zt, SumZ, stride_z, V, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    m = -float("inf")
    s = 0.0
    sz = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    t = tl.load(T + row).to(tl.int64) - vocab_start
    owned = (t >= 0) & (t < V)
    zt = tl.load(base + tl.where(owned, t, 0)).to(tl.float32)
    tl.store(Max + row, m)
    tl.store(SumExp + row, s)
    tl.store(Zt + row, tl.where(owned, zt, 0.0))
    tl.store(SumZ + row, sz)


@lazy_jit
def _grad_kernel(Z, T, Lse, G, DZ, stride_z, stride_dz, V, vocab_start, smooth_each, one_minus_eps,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(Lse + row)
    g = tl.load(G + row)
    t = tl.load(T + row).to(tl.int64) - vocab_start
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.exp(z - lse) - smooth_each
        d = tl.where(cols == t, d - one_minus_eps, d)
        tl.store(DZ + row * stride_dz + cols, (d * g).to(DZ.dtype.element_ty), mask=mask)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    z = logits.reshape(-1, logits.shape[-1])  # (N, V)
    return z if z.stride(-1) == 1 else z.contiguous()


def _block(V: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(V))


def _stats(z: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> CrossEntropyStats:
    N, V = z.shape
    out = [torch.empty(N, dtype=torch.float32, device=z.device) for _ in range(4)]
    _stats_kernel[(N,)](z, targets.contiguous(), *out, z.stride(0), V, int(vocab_start),
                        BLOCK=_block(V))
    return CrossEntropyStats(*out)


def _grad(z, targets, lse, grad_rows, vocab_start, vocab_size, label_smoothing) -> torch.Tensor:
    N, V = z.shape
    dz = torch.empty_like(z, memory_format=torch.contiguous_format)
    _grad_kernel[(N,)](z, targets.contiguous(), lse.contiguous(), grad_rows.contiguous(), dz,
                       z.stride(0), dz.stride(0), V, int(vocab_start),
                       float(label_smoothing) / vocab_size, 1.0 - float(label_smoothing),
                       BLOCK=_block(V))
    return dz


class _CrossEntropy(torch.autograd.Function):
    """Per-row losses ``(N,)`` fp32 from logits ``(N, V)``; 0 on ignored rows."""

    @staticmethod
    def forward(ctx, z, targets, ignore_index, label_smoothing):
        V = z.shape[1]
        st = _stats(z, targets, 0)
        lse = st.max + torch.log(st.sum_exp)
        loss = loss_from_stats(lse, st.target_logit, st.sum_logits, targets, vocab_size=V,
                               ignore_index=ignore_index, label_smoothing=label_smoothing)
        ctx.save_for_backward(z, targets, lse)
        ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
        return loss

    @staticmethod
    def backward(ctx, dloss):
        z, targets, lse = ctx.saved_tensors
        g = torch.where(targets != ctx.ignore_index, dloss.float(), torch.zeros_like(lse))
        dz = _grad(z, targets, lse, g, 0, z.shape[1], ctx.label_smoothing)
        return dz, None, None, None
