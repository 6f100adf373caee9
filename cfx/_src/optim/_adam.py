"""The Adam sweep shared by ``scale_by_adam`` and the fused ``adam`` / ``adamw`` aliases.

Per leaf (all ops elementwise, ``t`` the new count)::

    g   = g + l2 * p                                  (adam's L2 weight decay, optional)
    m'  = lerp(m, g, 1 - b1)                          v' = b2 * v + (1 - b2) * g * g
    u   = m' / (sqrt(v') + eps * sqrt(bc2)) * (sqrt(bc2) / bc1)     (= m_hat / (sqrt(v_hat) + eps))
    u   = u + wd * p                                  (decoupled weight decay, optional, masked)
    u   = u * (-lr)                                   (optional)

with ``bc = 1 - b ** t``. Two implementations of the same op sequence: ``foreach`` (multi-tensor
kernels over all leaves; for accelerators) and ``chunked`` (CPU: every op on one cache-sized chunk
of a leaf before the next chunk, writing into the fresh output tensors with ``out=``, so each
element is fetched from memory once rather than once per op). Inputs are never written.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from cfx._src.optim import _util

CHUNK = 1 << 18  # elements per chunk on CPU: ~8 arrays x 1 MiB stay in cache


class AdamOut(NamedTuple):
    mu: list[torch.Tensor]
    nu: list[torch.Tensor]
    updates: list[torch.Tensor]


def adam_sweep(gs: Sequence[torch.Tensor], mus: Sequence[torch.Tensor], nus: Sequence[torch.Tensor],
               count: torch.Tensor, *, b1: float, b2: float, eps: float,
               params: Sequence[torch.Tensor] | None = None, l2: float = 0.0, decay: float = 0.0,
               decay_flags: Sequence[bool] | None = None, lr: Any = None, impl: str | None = None,
               chunk: int = CHUNK) -> AdamOut:
    """New moments and updates for leaves ``gs``; ``count`` is the already incremented step."""
    bc1 = _util.bias_correction(b1, count)
    sqrt_bc2 = _util.bias_correction(b2, count).sqrt()
    scale, eps_t = sqrt_bc2 / bc1, eps * sqrt_bc2
    neg_lr = None if lr is None else -lr
    flags = [decay != 0.0 and (decay_flags is None or f)
             for f in (decay_flags if decay_flags is not None else [True] * len(gs))]
    if impl is None:
        impl = "chunked" if _chunkable(gs, mus, nus, params) else "foreach"
    if impl == "foreach":
        return _foreach(list(gs), list(mus), list(nus), params, b1, b2, scale, eps_t, l2, decay,
                        flags, neg_lr)
    return _chunked(gs, mus, nus, params, b1, b2, scale, eps_t, l2, decay, flags, neg_lr, chunk)


def _chunkable(*lists) -> bool:
    tensors = [x for xs in lists if xs is not None for x in xs]
    if any(x.device.type != "cpu" for x in tensors):
        return False
    # out= ops do not record autograd history: keep differentiable inputs on the foreach path
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


def _foreach(gs, mus, nus, ps, b1, b2, scale, eps_t, l2, decay, flags, neg_lr) -> AdamOut:
    if not gs:
        return AdamOut([], [], [])
    gs = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(gs, mus)]
    if l2:
        gs = torch._foreach_add(gs, ps, alpha=l2)
    mu = torch._foreach_lerp(mus, gs, 1.0 - b1)
    nu = torch._foreach_mul(nus, b2)
    torch._foreach_addcmul_(nu, gs, gs, value=1.0 - b2)
    denom = torch._foreach_sqrt(nu)
    torch._foreach_add_(denom, eps_t)
    u = torch._foreach_div(mu, denom)
    del denom
    torch._foreach_mul_(u, scale)
    idx = [i for i, f in enumerate(flags) if f]
    if idx:
        torch._foreach_add_([u[i] for i in idx], [ps[i] for i in idx], alpha=decay)
    if neg_lr is not None:
        torch._foreach_mul_(u, neg_lr)
    return AdamOut(mu, nu, u)


def _chunked(gs, mus, nus, ps, b1, b2, scale, eps_t, l2, decay, flags, neg_lr, chunk) -> AdamOut:
    out = AdamOut([], [], [])
    for i, (g, m, v) in enumerate(zip(gs, mus, nus)):
        p = ps[i] if ps is not None else None
        m2, v2, u = (torch.empty(m.shape, dtype=m.dtype) for _ in range(3))  # contiguous: flat views
        n = m.numel()
        tmp = torch.empty(min(n, chunk), dtype=m.dtype)
        tmp_g = torch.empty(min(n, chunk), dtype=m.dtype) if l2 or g.dtype != m.dtype else None
        flat = [x.reshape(-1) if x is not None else None for x in (g, m, v, p, m2, v2, u)]
        for s in range(0, n, chunk):
            g_c, m_c, v_c, p_c, m2_c, v2_c, u_c = (x[s:s + chunk] if x is not None else None
                                                    for x in flat)
            k = m_c.numel()
            if tmp_g is not None:
                g_c = torch.add(g_c.to(m.dtype), p_c, alpha=l2, out=tmp_g[:k]) if l2 \
                    else tmp_g[:k].copy_(g_c)
            torch.lerp(m_c, g_c, 1.0 - b1, out=m2_c)
            torch.mul(v_c, b2, out=v2_c).addcmul_(g_c, g_c, value=1.0 - b2)
            denom = torch.sqrt(v2_c, out=tmp[:k]).add_(eps_t)
            torch.div(m2_c, denom, out=u_c).mul_(scale)
            if flags[i]:
                u_c.add_(p_c, alpha=decay)
            if neg_lr is not None:
                u_c.mul_(neg_lr)
        out.mu.append(m2)
        out.nu.append(v2)
        out.updates.append(u)
    return out
