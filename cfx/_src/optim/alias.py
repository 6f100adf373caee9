"""Ready-made optimizers, each a ``chain`` of building blocks (optax's aliases).

Every alias chains the same stages whatever its hyperparameters (weight decay 0 is a stateless
no-op, momentum 0 an ``identity``), so each stage keeps its index in the state's paths.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from cfx._src.core import donation, tree as tree_util
from cfx._src.optim import _util
from cfx._src.optim._adam import adam_sweep, adamw_chunks, can_sweep_into, flat_chunk_kernel_applies
from cfx._src.optim.base import GradientTransformation, apply_updates, chain, identity
from cfx._src.optim.transforms import (
    ScaleByAdamState,
    ScaleByScheduleState,
    add_decayed_weights,
    scale_by_adam,
    scale_by_lars,
    scale_by_learning_rate,
    scale_by_trust_ratio,
    trace,
)

LearningRate = float | Callable[[torch.Tensor], Any]


def sgd(learning_rate: LearningRate, momentum: float = 0.0, *, nesterov: bool = False,
        weight_decay: float = 0.0) -> GradientTransformation:
    """torch.optim.SGD (dampening 0): ``g += wd * p``; ``t = momentum * t + g``;
    ``p -= lr * (t or g + momentum * t with nesterov)``."""
    _util.check_learning_rate("sgd", learning_rate)
    _util.check_nonneg("sgd", "momentum", momentum, "typical values are 0.9-0.99")
    if nesterov and momentum == 0.0:
        raise ValueError("cfx.optim.sgd: nesterov=True needs momentum > 0; set momentum=0.9, say.")
    return chain(
        add_decayed_weights(weight_decay),
        trace(momentum, nesterov=nesterov) if momentum else identity(),
        scale_by_learning_rate(learning_rate),
    )


def adam(learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0) -> GradientTransformation:
    """torch.optim.Adam: ``weight_decay`` is L2 regularisation added to the gradient before the
    moments (use ``adamw`` for decoupled decay).

    ``chain(add_decayed_weights(weight_decay), scale_by_adam(...), scale_by_learning_rate(lr))``,
    run as one fused sweep over the leaves (same state; the same numbers up to float rounding).
    """
    _util.check_learning_rate("adam", learning_rate)
    reference = chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(b1=b1, b2=b2, eps=eps),
        scale_by_learning_rate(learning_rate),
    )
    last: list = []  # the last update's gradient structure (``_fused_adam``)

    def update(updates, state, params=None, *, apply=False):
        _check_chain_state("adam", state, 3)
        if weight_decay and params is None:
            raise ValueError("cfx.optim.adam: weight decay needs the params; call "
                             "tx.update(grads, state, params).")
        decay_state, adam_state, lr_state = state
        updates, adam_state, lr_state = _fused_adam(
            updates, adam_state, lr_state, params, learning_rate, b1=b1, b2=b2, eps=eps,
            l2=weight_decay, apply=apply, last=last)
        return updates, (decay_state, adam_state, lr_state)

    def apply_fused(grads, state, params):
        return update(grads, state, params, apply=True)

    return GradientTransformation(reference.init, update, apply_fused)


def adamw(learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2, mask: Any = None, impl: str = "auto") -> GradientTransformation:
    """torch.optim.AdamW (Loshchilov & Hutter, 2019): ``p -= lr * (adam_direction + wd * p)``.

    ``mask`` (a pytree of bools like params, or ``params -> bools``) selects the leaves that
    decay, e.g. ``lambda params: cfx.tree.map(lambda p: p.ndim >= 2, params)``.

    When every leaf is a flat chunk (1-D contiguous fp32, as Gemini's chunks are) and ``impl``
    resolves to Triton (``auto``: on CUDA), each chunk is one launch of the fused kernel
    ``cfx_kernels.adamw`` (on copies: the inputs stay untouched).

    ``chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask=mask),
    scale_by_learning_rate(lr))``, run as one fused sweep over the leaves (same state; the same
    numbers up to float rounding).
    """
    _util.check_learning_rate("adamw", learning_rate)
    reference = chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )
    last: list = []  # the last update's gradient structure (``_fused_adam``)

    def update(updates, state, params=None, *, apply=False):
        _check_chain_state("adamw", state, 3)
        if weight_decay and params is None:
            raise ValueError("cfx.optim.adamw: weight decay needs the params; call "
                             "tx.update(grads, state, params).")
        adam_state, decay_state, lr_state = state
        updates, adam_state, lr_state = _fused_adam(
            updates, adam_state, lr_state, params, learning_rate, b1=b1, b2=b2, eps=eps,
            decay=weight_decay, mask=mask, impl=impl, apply=apply, last=last)
        return updates, (adam_state, decay_state, lr_state)

    def apply_fused(grads, state, params):
        return update(grads, state, params, apply=True)

    return GradientTransformation(reference.init, update, apply_fused)


def _check_chain_state(fn: str, state: Any, n: int) -> None:
    if not isinstance(state, tuple) or len(state) != n:
        raise ValueError(f"cfx.optim.{fn}: expected a state tuple of {n} entries, got "
                         f"{type(state).__name__}; pass the state returned by this optimizer's "
                         "init or update.")


def _fused_adam(updates, adam_state, lr_state, params, learning_rate, *, b1, b2, eps, l2=0.0,
                decay=0.0, mask=None, impl="reference", apply=False, last=None):
    """The Adam chain in one sweep (see ``_adam.py``): returns updates and the two new states;
    with ``apply``, the new params in place of the updates (written into donated params where
    ``can_sweep_into`` allows, else ``apply_updates``). ``last``: a list holding the structure of
    the last call's gradients, through which a step that rebuilds no tree reads its leaves
    (``tree.leaves_as``; every step of a training loop passes the same structures)."""
    traced = torch.compiler.is_dynamo_compiling()  # (a graph reads no structure of the last call)
    leaves = _adam_leaves(updates, adam_state, params, last if mask is None and not traced else None)
    gs, ps, mus, nus, treedef = leaves
    if callable(learning_rate):
        lr, lr_state = learning_rate(lr_state.count), ScaleByScheduleState(lr_state.count + 1)
    else:
        lr = learning_rate
    if not gs:
        count = _next_count(adam_state.count)
        return params if apply else updates, ScaleByAdamState(count, adam_state.mu, adam_state.nu), lr_state
    lr = _util.as_scalar(lr, gs[0].device)
    chunks = not l2 and ps is not None and flat_chunk_kernel_applies(impl, gs, mus, nus, ps)
    into = not chunks and apply and can_sweep_into(ps, mus, lr, adam_state.count)
    if treedef is None:  # read through ``last``: exact leaves, but the tree to rebuild is not known
        if into and donation.all_donated(mus) and donation.all_donated(nus):  # in place: none to rebuild
            treedef = last[0]
        else:
            gs, ps, mus, nus, treedef = _adam_leaves(updates, adam_state, params, None)
    flags = _util.resolve_mask("cfx.optim.add_decayed_weights", mask, params, len(gs)) \
        if decay else None
    count = _next_count(adam_state.count)  # after every check: a refused call leaves a donated count as it was
    if chunks:
        mu, nu, out = adamw_chunks(gs, mus, nus, ps, count, b1=b1, b2=b2, eps=eps, decay=decay,
                                   decay_flags=flags, lr=lr)
    else:
        mu, nu, out = adam_sweep(gs, mus, nus, count, b1=b1, b2=b2, eps=eps, params=ps, l2=l2,
                                 decay=decay, decay_flags=flags, lr=lr, into_params=into)
    # moments stepped in place (donated) are the old trees' very leaves: keep those trees
    new_state = ScaleByAdamState(count, adam_state.mu if mu is mus else tree_util.unflatten(treedef, mu),
                                 adam_state.nu if nu is nus else tree_util.unflatten(treedef, nu))
    if into:
        return params, new_state, lr_state
    out = tree_util.unflatten(treedef, out)
    return (apply_updates(params, out) if apply else out), new_state, lr_state


def _adam_leaves(updates, adam_state, params, last: list | None) -> tuple:
    """``(grads, params or None, mu, nu, treedef)`` as leaf lists, all shaped like the gradients
    (ValueError otherwise). Read through ``last[0]`` where it fits, with ``treedef`` None: a
    structure guess reads leaves exactly, but dict-like node types are not told apart
    (``tree.leaves_as``), so it rebuilds no tree; else ``last`` becomes this call's structure."""
    what = "cfx.optim update"
    gs = None if not last else tree_util.leaves_as(updates, last[0])
    if gs is None:
        gs, treedef = tree_util.flatten(updates)
        if last is not None:
            last[:] = [treedef]
        guess = treedef
    else:
        treedef, guess = None, last[0]
    ps = None if params is None else _util.leaves_like(f"{what} (params vs grads)", params, guess, updates)
    mus = _util.leaves_like(f"{what} (grads vs optimizer state)", adam_state.mu, guess, updates)
    nus = _util.leaves_like(f"{what} (grads vs optimizer state)", adam_state.nu, guess, updates)
    return gs, ps, mus, nus, treedef


def _next_count(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``: in the old count's buffer where its caller donated it (an in-place step then
    returns every buffer it was given as itself)."""
    if donation.is_donated(count) and not count.requires_grad:  # (an int count never does)
        return count.add_(1)
    return count + 1


def lamb(learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """LAMB (You et al., 2019): ``r = m_hat / (sqrt(v_hat) + eps) + wd * p`` and, per leaf,
    ``p -= lr * ||p|| / ||r|| * r`` (ratio 1 where either norm is 0). ``mask`` selects the
    leaves that decay."""
    _util.check_learning_rate("lamb", learning_rate)
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )


def lars(learning_rate: LearningRate, *, momentum: float = 0.9, weight_decay: float = 0.0,
         trust_coefficient: float = 1e-3, eps: float = 0.0, nesterov: bool = False,
         mask: Any = None) -> GradientTransformation:
    """LARS (You et al., 2017), Algorithm 1: per leaf
    ``lam = eta * ||p|| / (||g|| + wd * ||p||)``, ``v = momentum * v + lr * lam * (g + wd * p)``,
    ``p -= v``. Leaves where ``mask`` is False get plain momentum SGD (no decay, no ``lam``)."""
    _util.check_learning_rate("lars", learning_rate)
    _util.check_nonneg("lars", "momentum", momentum, "typical values are 0.9")
    if nesterov and momentum == 0.0:
        raise ValueError("cfx.optim.lars: nesterov=True needs momentum > 0; set momentum=0.9, say.")
    return chain(
        scale_by_lars(trust_coefficient, weight_decay=weight_decay, eps=eps, mask=mask),
        scale_by_learning_rate(learning_rate),
        trace(momentum, nesterov=nesterov) if momentum else identity(),
    )
