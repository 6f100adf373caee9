"""Flash attention over one block of keys of a bigger attention (ring attention's inner step).

``flash_attention_block`` returns the block's output and each query's log-sum-exp over it, so
blocks combine by their log-sum-exp; ``flash_attention_block_backward`` gives one block's share
of the whole attention's gradients from the whole's output and log-sum-exp. Both run the Triton
kernels of ``flash_attention`` (``impl="auto"``: on CUDA tensors they take) or the plain-PyTorch
references of ``attention_reference``.
"""
from __future__ import annotations

import torch

from cfx_kernels._common import on_device, resolve_impl
from cfx_kernels.attention_reference import (allowed_keys, attention_block_backward_reference,
                                             attention_block_reference, check_inputs)
from cfx_kernels.flash_attention import _LOG2E, _backward, _forward, triton_unsupported

__all__ = ["flash_attention_block", "flash_attention_block_backward"]


def _block_impl(impl: str, q, k, v, mask) -> str:
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError("cfx_kernels.flash_attention: block attention takes bool masks (True = attend), "
                         f"got dtype {mask.dtype}.")
    which = resolve_impl(impl, q, k, v)
    reason = triton_unsupported(q, k, v) if which == "triton" else None
    if reason is not None and impl == "triton":
        raise ValueError(f"cfx_kernels.flash_attention: {reason}.")
    return "reference" if which == "reference" or reason is not None else "triton"


def _empty_rows(mask, causal, T, S, device):
    """Bool (B|1, 1, T|1) of the queries that see no key, or None when every query sees one."""
    if mask is None and not (causal and T > S):
        return None
    return ~allowed_keys(mask, causal, T, S, device).any(-1)[:, None]  # (B|1, 1, 1|T)


def flash_attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                          mask: torch.Tensor | None = None, scale: float | None = None,
                          impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` over one block of keys (see ``attention_block_reference``):
    ``lse`` ``(B, H, T)`` fp32, natural log, ``-inf`` where a query sees no key. Not
    differentiable itself: ring attention differentiates the whole with
    ``flash_attention_block_backward``. ``impl`` as for ``flash_attention``."""
    check_inputs(q, k, v, mask=mask, scale=scale)
    if _block_impl(impl, q, k, v, mask) == "reference":
        return attention_block_reference(q, k, v, causal=causal, mask=mask, scale=scale)
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.no_grad(), on_device(q):
        o, lse2 = _forward(q, k, v, mask, bool(causal), scale)
    lse = lse2 / _LOG2E  # the kernel's log2 units -> natural log
    empty = _empty_rows(mask, causal, q.shape[1], k.shape[1], q.device)
    return o, lse if empty is None else lse.masked_fill(empty, float("-inf"))


def flash_attention_block_backward(q, k, v, out, lse, dout, *, causal: bool, mask: torch.Tensor | None = None,
                                   scale: float | None = None, impl: str = "auto"):
    """``(dq, dk, dv)`` of one block's share of an attention whose whole output is ``out`` with
    log-sum-exp ``lse`` (see ``attention_block_backward_reference``)."""
    if _block_impl(impl, q, k, v, mask) == "reference":
        return attention_block_backward_reference(q, k, v, out, lse, dout, causal=causal, mask=mask, scale=scale)
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    lse2 = (lse.masked_fill(lse == float("-inf"), 0.0) * _LOG2E).contiguous()  # empty rows: p = 0 anyway
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.no_grad(), on_device(q):
        return _backward(q, k, v, mask, out.contiguous(), lse2, dout.contiguous(), bool(causal), scale)
