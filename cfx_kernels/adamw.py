"""Fused AdamW over flat buffers: one launch updates a whole chunk in place.

``adamw_flat_(param, grad, exp_avg, exp_avg_sq, step=, lr=, ...)`` takes 1-D contiguous
buffers of one chunk (fp32 param and moments; the grad may be fp32, fp16 or bf16) and applies
``torch.optim.AdamW``'s step, decoupled weight decay and bias correction included::

    p  *= 1 - lr * wd
    m   = lerp(m, g, 1 - b1)               v = b2 * v + (1 - b2) * g * g
    p  -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

``step`` is the 1-based step count after this update (torch's ``state["step"]``). Each element is
read once and written once: 16 bytes read (14 with a half-precision grad) and 12 written.
Hyperparameters are Python numbers (a 0-d tensor ``lr`` is read with ``float``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cfx_kernels._common import resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.adamw_reference import adamw_flat_reference_

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024

__all__ = ["adamw_flat_"]


def _check(param, grad, exp_avg, exp_avg_sq, step) -> None:
    bufs = (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    for name, t in bufs:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous():
            got = (f"shape {tuple(t.shape)}, strides {t.stride()}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"adamw_flat_: {name} must be a 1-D contiguous tensor (a flat chunk), "
                             f"got {got}.")
        if t.numel() != param.numel():
            raise ValueError(f"adamw_flat_: {name} has {t.numel()} elements but param has "
                             f"{param.numel()}; all four buffers must cover the same chunk.")
        if t.device != param.device:
            raise ValueError(f"adamw_flat_: {name} is on {t.device} but param is on {param.device}.")
        if name == "grad":
            if t.dtype not in GRAD_DTYPES:
                raise ValueError(f"adamw_flat_: grad must be one of {[str(d) for d in GRAD_DTYPES]}, "
                                 f"got {t.dtype}.")
        elif t.dtype != torch.float32:
            raise ValueError(f"adamw_flat_: {name} must be float32 (master weights and moments), "
                             f"got {t.dtype}.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_flat_: step must be the 1-based step count (an int >= 1), got {step!r}.")


def adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                impl: str = "auto") -> torch.Tensor:
    """One AdamW step in place on the flat ``param``, ``exp_avg``, ``exp_avg_sq``; returns ``param``."""
    _check(param, grad, exp_avg, exp_avg_sq, step)
    lr, b1, b2, eps, weight_decay = (float(v) for v in (lr, b1, b2, eps, weight_decay))
    if resolve_impl(impl, param, grad, exp_avg, exp_avg_sq) == "reference" or param.numel() == 0:
        return adamw_flat_reference_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, b1=b1,
                                     b2=b2, eps=eps, weight_decay=weight_decay)
    n = param.numel()
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, n, 1.0 - lr * weight_decay, 1.0 - b1, b2, 1.0 - b2,
        lr / (1.0 - b1 ** step), (1.0 - b2 ** step) ** 0.5, eps, BLOCK=BLOCK)
    return param


@lazy_jit
def _adamw_kernel(P, G, M, V, n, decay, one_minus_b1, b2, one_minus_b2, step_size, sqrt_bc2, eps,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + one_minus_b1 * (g - m)  # torch.lerp for weights < 0.5
    v = v * b2 + one_minus_b2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
