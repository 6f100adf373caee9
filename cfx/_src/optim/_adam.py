"""The Adam sweep shared by ``scale_by_adam`` and the fused ``adam`` / ``adamw`` aliases.

Per leaf (all ops elementwise, ``t`` the new count)::

    g   = g + l2 * p                                  (adam's L2 weight decay, optional)
    m'  = lerp(m, g, 1 - b1)                          v' = b2 * v + (1 - b2) * g * g
    u   = m' / (sqrt(v') + eps * sqrt(bc2)) * (sqrt(bc2) / bc1)     (= m_hat / (sqrt(v_hat) + eps))
    u   = u + wd * p                                  (decoupled weight decay, optional, masked)
    u   = u * (-lr)                                   (optional)

with ``bc = 1 - b ** t``, as multi-tensor (``torch._foreach_*``) kernels over all leaves: a
handful of launches per step however many leaves there are. Where the caller donated params and
moments (an eager ``cfx.jit(..., donate_argnums=...)`` step through ``optim.apply_gradients``),
torch's one-pass Adam kernels do the whole sweep in place instead (``_one_pass``). Inputs are
written only where their caller donated them (``cfx._src.core.donation``): donated moments are
updated in place, and donated gradients hold the denominator and then the update, so a donated
step allocates nothing the size of the model; the numbers are the same either way. (A
cache-blocked CPU variant was measured slower inside a real GPT-2 train step, where fresh
outputs cost page reuse, not bandwidth.)
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, NamedTuple, Sequence

import torch

from cfx._src.core import donation
from cfx._src.optim import _util
from cfx._src.transforms.shapes import any_abstract, is_abstract


class AdamOut(NamedTuple):
    mu: list[torch.Tensor]
    nu: list[torch.Tensor]
    updates: list[torch.Tensor]


def adam_sweep(gs: Sequence[torch.Tensor], mus: Sequence[torch.Tensor], nus: Sequence[torch.Tensor],
               count: torch.Tensor, *, b1: float, b2: float, eps: float,
               params: Sequence[torch.Tensor] | None = None, l2: float = 0.0, decay: float = 0.0,
               decay_flags: Sequence[bool] | None = None, lr: Any = None,
               into_params: bool = False) -> AdamOut:
    """New moments and updates for leaves ``gs``; ``count`` is the already incremented step.

    ``into_params`` (the caller checked ``can_sweep_into``): the updates are added straight into
    ``params`` (decay first, as ``torch.optim.AdamW`` does) and returned in place of updates.
    Moments updated in place come back as the very lists ``mus`` and ``nus`` (so a caller may keep
    their trees)."""
    if decay_flags is None:
        flags = [decay != 0.0] * len(gs)
    else:
        flags = [decay != 0.0 and f for f in decay_flags]
    if into_params:
        groups = _one_pass_groups(gs, mus, nus, params)
        if groups is not None:
            return _one_pass(gs, mus, nus, params, count, groups, b1=b1, b2=b2, eps=eps, l2=l2,
                             decay=decay, flags=flags, lr=lr)
    bc1 = _util.bias_correction(b1, count)
    sqrt_bc2 = _util.bias_correction(b2, count).sqrt()
    scale, eps_t = sqrt_bc2 / bc1, eps * sqrt_bc2
    neg_lr = None if lr is None else -lr
    return _foreach(list(gs), mus, nus, params, b1, b2, scale, eps_t, l2, decay, flags, neg_lr, into_params)


_ONE_PASS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_dtype, _device, _is_cpu = operator.attrgetter("dtype"), operator.attrgetter("device"), operator.attrgetter("is_cpu")


def _one_pass_groups(gs, mus, nus, ps) -> list[list[int]] | None:
    """Whether torch's one-pass Adam kernels (``torch._fused_adam_`` / ``_fused_adamw_``, what
    ``torch.optim.AdamW(fused=True)`` runs) can step these leaves in place -- eager, moments and
    params donated, one floating dtype and device per leaf, on the CPU or CUDA -- and if so the
    leaves grouped by device and dtype as ``torch.optim`` groups them (one group, one call, in
    the usual case of one device and one dtype); None where they cannot."""
    if torch.compiler.is_dynamo_compiling() or not hasattr(torch, "_fused_adamw_"):
        return None  # a compiled step fuses the foreach sweep itself
    if not donation.all_donated([*mus, *nus]):
        return None
    dtypes = set(map(_dtype, itertools.chain(gs, mus, nus, ps)))
    if ps and all(map(_is_cpu, itertools.chain(gs, ps))):  # (``.device`` makes an object per tensor: read it once)
        devices = {ps[0].device}
    else:
        devices = set(map(_device, itertools.chain(gs, ps)))
    if len(dtypes) == 1 and len(devices) == 1:  # the usual case, in C-level passes (this runs every step)
        kinds = {(*devices, *dtypes)}
    else:  # leaf by leaf: each leaf's four tensors of one kind
        dtypes, devices = list(map(_dtype, ps)), list(map(_device, ps))
        if not (list(map(_dtype, gs)) == list(map(_dtype, mus)) == list(map(_dtype, nus)) == dtypes
                and list(map(_device, gs)) == devices):
            return None
        kinds = set(zip(devices, dtypes))
    if any(device.type not in ("cpu", "cuda") or dtype not in _ONE_PASS_DTYPES for device, dtype in kinds):
        return None
    if any_abstract(ps):
        return None
    if len(kinds) == 1:
        return [list(range(len(ps)))]
    groups: dict[tuple, list[int]] = {}
    for i, kind in enumerate(zip(devices, dtypes)):
        groups.setdefault(kind, []).append(i)
    return list(groups.values())


def _one_pass(gs, mus, nus, ps, count, groups, *, b1, b2, eps, l2, decay, flags, lr) -> AdamOut:
    """The sweep as one pass per leaf that reads the gradient and writes the moments and the
    params in place: no intermediate the size of the model, one trip through memory (the foreach
    sweep makes six). One kernel call per group of ``_one_pass_groups`` (device and dtype) and,
    for adamw with a mask, per side of it, as ``torch.optim.AdamW(fused=True)`` makes one per param
    group: a single call over every leaf in the usual case."""
    step = count.to(torch.float32)  # read only: the count was already incremented
    kernel, lr = (torch._fused_adam_ if l2 else torch._fused_adamw_), float(lr)
    for idx in groups:
        if l2:  # adam's coupled L2 on the gradient, every leaf alike
            parts = [(idx, l2)]
        else:
            on = list(map(flags.__getitem__, idx))  # (C-level passes: one group is every leaf)
            parts = [(list(itertools.compress(idx, on)), decay),
                     (list(itertools.compress(idx, map(operator.not_, on))), 0.0)]
        for part, wd in parts:
            if not part:
                continue
            pick = (lambda xs: xs) if len(part) == len(gs) else (lambda xs: [xs[i] for i in part])  # noqa: E731
            kernel(pick(ps), pick(gs), pick(mus), pick(nus), [], [step] * len(part), lr=lr, beta1=b1,
                   beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
    return AdamOut(mus, nus, ps)


def can_sweep_into(params: Sequence[torch.Tensor] | None, mus: Sequence[torch.Tensor], lr: Any,
                   count: torch.Tensor) -> bool:
    """Whether the sweep may write into ``params``: every one donated (``cfx._src.core.donation``) and
    of its moment's dtype, and the step size a number (the bias correction is then read once)."""
    return (params is not None and isinstance(lr, (int, float)) and not is_abstract(count)
            and donation.all_donated(params) and list(map(_dtype, params)) == list(map(_dtype, mus)))


def _per(xs: list, t: Any) -> Any:
    """A 0-d tensor operand of a foreach op; per tensor when it has no value (a shape-only run,
    whose fake tensors cannot take the one-scalar form without reading it)."""
    return [t] * len(xs) if is_abstract(t) else t


def _foreach(gs, mus, nus, ps, b1, b2, scale, eps_t, l2, decay, flags, neg_lr, into_params) -> AdamOut:
    if not gs:
        return AdamOut([], [], [])
    own = [donation.is_donated(g) or g.dtype != m.dtype for g, m in zip(gs, mus)]  # casts are fresh: ours
    gs = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(gs, mus)]
    if l2:
        gs, own = torch._foreach_add(gs, ps, alpha=l2), [True] * len(gs)
    own_g = all(own)
    if donation.all_donated(mus) and donation.all_donated(nus):
        mu, nu = mus, nus
        torch._foreach_lerp_(mu, gs, 1.0 - b1)
        torch._foreach_mul_(nu, b2)
    else:
        mu = torch._foreach_lerp(mus, gs, 1.0 - b1)
        nu = torch._foreach_mul(nus, b2)
    torch._foreach_addcmul_(nu, gs, gs, value=1.0 - b2)
    # one buffer per leaf takes the denominator, then the update: the gradient's when it is spent,
    # else a fresh one (one model-sized allocation a step, not two: fresh pages cost more than the math)
    if own_g:
        u = gs
        for v, d in zip(nu, u):
            torch.sqrt(v, out=d)
    else:
        u = torch._foreach_sqrt(nu)
    torch._foreach_add_(u, _per(u, eps_t))
    idx = [i for i, f in enumerate(flags) if f]
    if into_params:  # p <- p * (1 - lr * decay) - lr * scale * m / d: no updates tree at all
        if idx:
            torch._foreach_mul_([ps[i] for i in idx], 1.0 + neg_lr * decay)
        torch._foreach_addcdiv_(ps, mu, u, value=float(scale) * neg_lr)
        return AdamOut(mu, nu, ps)
    for m, d in zip(mu, u):
        torch.div(m, d, out=d)
    if isinstance(neg_lr, float):  # fold the step size into one pass; decay gets -lr * decay
        torch._foreach_mul_(u, _per(u, scale * neg_lr))
        if idx:
            torch._foreach_add_([u[i] for i in idx], [ps[i] for i in idx], alpha=neg_lr * decay)
        return AdamOut(mu, nu, u)
    torch._foreach_mul_(u, _per(u, scale))
    if idx:
        torch._foreach_add_([u[i] for i in idx], [ps[i] for i in idx], alpha=decay)
    if neg_lr is not None:
        torch._foreach_mul_(u, _per(u, neg_lr))
    return AdamOut(mu, nu, u)


def flat_chunk_kernel_applies(impl: str, *lists: Sequence[torch.Tensor]) -> bool:
    """True when every leaf is a flat fp32 chunk and ``impl`` resolves to the Triton kernel."""
    if impl == "reference" or any(x.dim() != 1 for x in lists[0]):  # most often a 2-d weight, at once
        return False
    tensors = [x for xs in lists for x in xs]
    if not all(x.dim() == 1 and x.is_contiguous() and x.dtype == torch.float32 for x in tensors):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return False
    from cfx_kernels._common import resolve_impl
    return resolve_impl(impl, *tensors) == "triton"


def adamw_chunks(gs, mus, nus, ps, count, *, b1, b2, eps, decay, decay_flags, lr) -> AdamOut:
    """AdamW on flat chunks with the fused kernel, one launch per chunk, on fresh copies."""
    from cfx_kernels.adamw import adamw_flat_
    step, lr = int(count), float(lr)
    flags = decay_flags if decay_flags is not None else [True] * len(gs)
    out = AdamOut([], [], [])
    for g, m, v, p, f in zip(gs, mus, nus, ps, flags):
        p2, m2, v2 = p.clone(), m.clone(), v.clone()
        adamw_flat_(p2, g, m2, v2, step=step, lr=lr, b1=b1, b2=b2, eps=eps,
                    weight_decay=decay if f else 0.0, impl="triton")
        out.mu.append(m2)
        out.nu.append(v2)
        out.updates.append(p2.sub_(p))  # the update that apply_updates adds back
    return out
