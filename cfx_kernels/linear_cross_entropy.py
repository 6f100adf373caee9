"""Linear + softmax cross-entropy, fused: the loss of ``hidden @ weight.T (+ bias)`` against
integer targets without ever holding the ``(N, V)`` logits.

``linear_cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100,
label_smoothing=0.0, reduction="mean", chunk_size=None, impl="auto")`` equals
``linear_cross_entropy_reference`` (``F.cross_entropy(F.linear(hidden, weight, bias).float(),
targets, ...)``) for hidden ``(..., C)``, weight ``(V, C)`` (an ``nn.Linear(C, V)``'s weight: the
LM head, or a tied embedding) and targets ``(...)``, in loss and in gradients.

How (Liger-Kernel's scheme). The forward walks the rows ``chunk_size`` at a time::

    z    = h_c @ W.T + b                       # (n, V), the matmul in the inputs' dtype
    lse, loss_c                                # per row, fp32: cross_entropy_stats, loss_from_stats
    dz   = (softmax(z) - onehot) * scale       # (n, V), cross_entropy_shard_grad, in z's dtype
    dh[c] = dz @ W                             # (n, C)
    dW  += dz.T @ h_c ;  db += dz.sum(0)       # (V, C), (V,): accumulated in fp32

where ``scale`` is the reduction's weight of each row (``1 / n_valid`` for ``mean``, 1 for
``sum``, 0 on ignored rows; ``label_smoothing`` mixes ``eps / V`` into the one-hot). So the
gradients are ready when the forward ends and backward only multiplies them by the loss's
gradient. ``reduction="none"`` cannot do that (a row's weight is known only in backward): its
backward walks the chunks again with ``scale = grad_output``. With no input requiring grad
(inference, ``torch.no_grad()``) the walk computes the losses alone.

``impl`` picks how a chunk's loss and ``dz`` are computed, through ``cfx_kernels.cross_entropy``:
its Triton kernels (``auto`` on CUDA), which read the logits in their dtype and write ``dz`` in
it, or its plain-PyTorch reference (fp32; fp64 for fp64 inputs). The matmuls are torch's.

Memory. Besides the inputs and the gradients (``dh`` in hidden's dtype, ``dW`` / ``db`` in the
weight's), the walk holds ``dW``'s fp32 accumulator while the forward runs (``4 V C`` bytes; for
fp32 weights it is the gradient itself) and one chunk's work: its logits and ``dz`` (``n x V``
each, in the inputs' dtype) and, on the reference path, a few fp32 ``n x V`` temporaries. The
default ``chunk_size``, ``default_chunk_size(V)``, keeps a chunk's fp32 logits within
``CHUNK_BYTES`` (256 MiB): ``CHUNK_BYTES // (4 V)`` rows, rounded down to a multiple of 64 when
above 64 (1280 rows at V = 50257, 512 at V = 128256).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from cfx_kernels._common import resolve_impl
from cfx_kernels.cross_entropy import (
    DTYPES,
    REDUCTIONS,
    cross_entropy_shard_grad,
    cross_entropy_stats,
    loss_from_stats,
)

CHUNK_BYTES = 256 * 2**20
_WHERE = "linear_cross_entropy"

__all__ = ["CHUNK_BYTES", "default_chunk_size", "linear_cross_entropy"]


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk such that a chunk's fp32 logits fit in ``CHUNK_BYTES`` (module docstring)."""
    rows = max(1, CHUNK_BYTES // (4 * vocab_size))
    return rows - rows % 64 if rows > 64 else rows


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk_size: int | None = None, impl: str = "auto") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, in fp32 (fp64 for fp64
    inputs), a chunk of rows at a time (module docstring).

    hidden ``(..., C)``, weight ``(V, C)`` and bias ``(V,)`` share one floating dtype; targets
    ``(...)`` are class ids or ``ignore_index``. ``mean`` averages over the targets that are not
    ``ignore_index`` (NaN if there are none, as in PyTorch); ``none`` returns the per-row losses
    (0 on ignored rows) with targets' shape. Gradients come back in the inputs' dtypes. Under
    ``torch.autocast`` the matmuls run in its dtype, as ``F.linear``'s would.
    """
    _check_options(reduction, label_smoothing, chunk_size)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check_tensors(hidden, weight, bias, targets, ignore_index)
    resolved = resolve_impl(impl, *(x for x in (hidden, weight, bias, targets) if x is not None))
    if resolved == "triton" and hidden.dtype not in DTYPES:
        raise ValueError(f"{_WHERE}: hidden and weight have dtype {hidden.dtype}; the Triton kernels "
                         f"take {[str(d) for d in DTYPES]} (use impl='reference' for others).")
    V, C = weight.shape
    opts = _Options(int(ignore_index), float(label_smoothing), reduction,
                    chunk_size or default_chunk_size(V), resolved)
    h, t = hidden.reshape(-1, C), targets.reshape(-1)  # (N, C), (N,)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        out = _LinearCrossEntropy.apply(h, weight, bias, t, opts)
    else:  # nothing to differentiate: the losses alone
        out = _reduce(_walk(h, weight, bias, t, opts).losses, t, opts)
    return out.view(targets.shape) if reduction == "none" else out


# ---------------------------------------------------------------------------------------------
# checks

def _check_options(reduction: str, label_smoothing: float, chunk_size: int | None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_WHERE}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_WHERE}: label_smoothing must lie in [0, 1], got {label_smoothing!r}.")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{_WHERE}: chunk_size must be a positive number of rows, or None for "
                         f"default_chunk_size(V); got {chunk_size!r}.")


def _autocast(*xs):
    """The floating tensors cast to the autocast dtype where autocast is on (``F.linear`` is on
    its lower-precision list); the walk itself runs with autocast off."""
    floats = [x for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floats or not torch.is_autocast_enabled(floats[0].device.type):
        return xs
    dtype = torch.get_autocast_dtype(floats[0].device.type)
    return tuple(x.to(dtype) if any(x is f for f in floats) else x for x in xs)


def _describe(x) -> str:
    return (f"dtype {x.dtype}, shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
            else type(x).__name__)


def _check_tensors(hidden, weight, bias, targets, ignore_index) -> None:
    named = [("hidden", hidden), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{_WHERE}: {name} must be a floating-point tensor, got {_describe(x)}.")
    if hidden.dim() < 1:
        raise ValueError(f"{_WHERE}: hidden must be (..., C), got a 0-dim tensor.")
    C = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != C or weight.shape[0] == 0:
        raise ValueError(f"{_WHERE}: weight must be (V, C) with V >= 1 and C = hidden.shape[-1] = {C}, "
                         f"got shape {tuple(weight.shape)}; pass an nn.Linear(C, V)'s weight (the LM "
                         f"head's, or the tied embedding), not its transpose.")
    V = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"{_WHERE}: bias must be (V,) = ({V},), got shape {tuple(bias.shape)}.")
    if len({x.dtype for _, x in named}) > 1:
        got = ", ".join(f"{name} {x.dtype}" for name, x in named)
        raise ValueError(f"{_WHERE}: hidden, weight and bias must share one dtype, got {got}; cast "
                         f"them first (e.g. hidden.to(weight.dtype)).")
    if (not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex()
            or targets.dtype == torch.bool):
        raise ValueError(f"{_WHERE}: targets must be an integer tensor of class ids, got "
                         f"{_describe(targets)}.")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{_WHERE}: targets shape {tuple(targets.shape)} must equal hidden's shape "
                         f"without its last (feature) dim, {tuple(hidden.shape[:-1])}.")
    devices = {str(x.device) for x in (hidden, weight, bias, targets) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"{_WHERE}: hidden, weight, bias and targets must be on one device, got "
                         f"{sorted(devices)}.")
    if targets.device.type == "cpu":  # checked where it costs no device sync (not on CUDA)
        bad = targets[(targets != ignore_index) & ((targets < 0) | (targets >= V))]
        if bad.numel():
            raise ValueError(f"{_WHERE}: targets must be class ids in [0, V) = [0, {V}) or "
                             f"ignore_index ({ignore_index}), got {bad[0].item()}.")


# ---------------------------------------------------------------------------------------------
# the walk over row chunks

@dataclasses.dataclass(frozen=True)
class _Options:
    ignore_index: int
    label_smoothing: float
    reduction: str
    chunk: int  # rows per chunk
    impl: str  # resolved: "triton" or "reference"


class _Walked(NamedTuple):
    losses: torch.Tensor  # (N,) fp32 (fp64 for fp64 inputs), 0 on ignored rows
    dh: torch.Tensor | None  # (N, C) in hidden's dtype
    dw: torch.Tensor | None  # (V, C) in weight's dtype
    db: torch.Tensor | None  # (V,) in bias's dtype


def _walk(h, w, b, t, opts: _Options, scale=None, need=(False, False, False)) -> _Walked:
    """One pass over the rows, ``opts.chunk`` at a time: the per-row losses and, for the inputs
    ``need`` names (h, w, b), the gradients of ``sum(scale * losses)``; ``scale`` (N,) is 0 on
    ignored rows. h ``(N, C)``, w ``(V, C)``, b ``(V,)`` or None, t ``(N,)``."""
    (N, C), V = h.shape, w.shape[0]
    acc = torch.promote_types(w.dtype, torch.float32)
    losses = torch.empty(N, dtype=acc, device=h.device)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need[0] else None
    dw = torch.zeros(V, C, dtype=acc, device=w.device) if need[1] else None
    db = torch.zeros(V, dtype=acc, device=w.device) if need[2] else None
    with torch.autocast(h.device.type, enabled=False):  # in the inputs' dtypes (see _autocast)
        for lo in range(0, N, opts.chunk):
            _chunk(h, w, b, t, opts, slice(lo, min(N, lo + opts.chunk)), losses, scale, dh, dw, db)
    return _Walked(losses, dh, None if dw is None else dw.to(w.dtype),
                   None if db is None else db.to(b.dtype))


def _chunk(h, w, b, t, opts: _Options, rows: slice, losses, scale, dh, dw, db) -> None:
    """One chunk of ``_walk``: its losses into ``losses[rows]``; with ``scale``, its rows of ``dh``
    and its terms of ``dw`` / ``db`` (each where not None)."""
    h_c, t_c, V = h[rows], t[rows], w.shape[0]  # (n, C), (n,)
    z = h_c @ w.T if b is None else torch.addmm(b, h_c, w.T)  # (n, V)
    st = cross_entropy_stats(z, t_c, impl=opts.impl)
    lse = st.max + torch.log(st.sum_exp)  # (n,)
    losses[rows] = loss_from_stats(lse, st.target_logit, st.sum_logits, t_c, vocab_size=V,
                                   ignore_index=opts.ignore_index, label_smoothing=opts.label_smoothing)
    if scale is None:
        return
    dz = cross_entropy_shard_grad(z, t_c, lse, scale[rows], vocab_start=0, vocab_size=V,
                                  label_smoothing=opts.label_smoothing, impl=opts.impl)
    del z, st  # (n, V): dz in z's dtype
    if dh is not None:
        torch.mm(dz, w, out=dh[rows])
    if dw is not None:
        if dw.dtype == dz.dtype:
            dw.addmm_(dz.T, h_c)
        else:  # the chunk's product rounds once to the inputs' dtype; the sum over chunks is fp32
            dw += dz.T @ h_c
    if db is not None:
        db += dz.sum(0, dtype=db.dtype)


def _reduce(losses: torch.Tensor, t: torch.Tensor, opts: _Options) -> torch.Tensor:
    if opts.reduction == "none":
        return losses
    if opts.reduction == "sum":
        return losses.sum()
    return losses.sum() / (t != opts.ignore_index).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss (or the per-row losses, ``none``) from h ``(N, C)``, w ``(V, C)``, b ``(V,)`` or
    None and t ``(N,)``; for ``mean`` / ``sum`` the gradients are computed in the forward."""

    @staticmethod
    def forward(ctx, h, w, b, t, opts):
        ctx.opts = opts
        if opts.reduction == "none":  # a row's gradient weight comes with grad_output
            ctx.save_for_backward(h, w, b, t)
            return _walk(h, w, b, t, opts).losses
        valid = t != opts.ignore_index  # (N,)
        acc = torch.promote_types(w.dtype, torch.float32)
        if opts.reduction == "sum":
            scale = valid.to(acc)
        else:  # 0 on ignored rows even when no row is valid (the loss is NaN then, as in torch)
            scale = torch.where(valid, 1.0 / valid.sum().to(acc), 0.0)
        walked = _walk(h, w, b, t, opts, scale=scale, need=tuple(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(walked.dh, walked.dw, walked.db)
        return _reduce(walked.losses, t, opts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        opts = ctx.opts
        if opts.reduction == "none":
            h, w, b, t = ctx.saved_tensors
            scale = torch.where(t != opts.ignore_index, grad, 0.0)  # (N,)
            walked = _walk(h, w, b, t, opts, scale=scale, need=tuple(ctx.needs_input_grad[:3]))
            return walked.dh, walked.dw, walked.db, None, None
        dh, dw, db = (None if g is None else g * grad for g in ctx.saved_tensors)
        return dh, dw, db, None, None
