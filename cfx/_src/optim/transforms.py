"""Building blocks: scaling, Adam moments, momentum, weight decay, trust ratios.

Each is a factory returning a ``GradientTransformation``; the aliases in ``alias.py`` chain them.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim import _util
from cfx._src.optim._adam import adam_sweep
from cfx._src.optim.base import GradientTransformation, init_empty_state

PyTree = Any


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor  # 0-d int32: number of updates so far


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # 0-d int32
    mu: PyTree           # first moment, like params
    nu: PyTree           # second moment, like params


class TraceState(NamedTuple):
    trace: PyTree        # momentum buffer, like params


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiplies updates by a constant ``step_size``."""

    def update(updates, state, params=None):
        del params
        us, treedef = tree_util.flatten(updates)
        if not us:
            return updates, state
        s = _util.as_scalar(step_size, us[0].device)
        return tree_util.unflatten(treedef, torch._foreach_mul(us, s)), state

    return GradientTransformation(init_empty_state, update)


def scale_by_schedule(step_size_fn: Callable[[torch.Tensor], Any]) -> GradientTransformation:
    """Multiplies updates by ``step_size_fn(count)``; ``count`` (a 0-d int32 tensor) starts at 0."""
    if not callable(step_size_fn):
        raise ValueError("cfx.optim.scale_by_schedule: step_size_fn must be callable (step -> "
                         f"value), got {type(step_size_fn).__name__}; use cfx.optim.scale for a "
                         "constant.")

    def init(params):
        return ScaleByScheduleState(count=_util.zero_count(params))

    def update(updates, state, params=None):
        del params
        us, treedef = tree_util.flatten(updates)
        new_state = ScaleByScheduleState(count=state.count + 1)
        if not us:
            return updates, new_state
        s = _util.as_scalar(step_size_fn(state.count), us[0].device)
        return tree_util.unflatten(treedef, torch._foreach_mul(us, s)), new_state

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: float | Callable[[torch.Tensor], Any], *,
                           flip_sign: bool = True) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate`` (a float or a schedule ``step -> lr``)."""
    _util.check_learning_rate("scale_by_learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


def scale_by_adam(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` (Kingma & Ba, 2015), as torch.optim.Adam."""
    _util.check_beta("scale_by_adam", "b1", b1)
    _util.check_beta("scale_by_adam", "b2", b2)
    _util.check_nonneg("scale_by_adam", "eps", eps, "typical values are 1e-8 to 1e-6")

    def init(params):
        return ScaleByAdamState(count=_util.zero_count(params), mu=_util.zeros_like_tree("adam/adamw/lamb", params),
                                nu=_util.zeros_like_tree("adam/adamw/lamb", params))

    def update(updates, state, params=None):
        del params
        gs, treedef = tree_util.flatten(updates)
        what = "cfx.optim.scale_by_adam (grads vs state)"
        mus = _util.leaves_like(what, state.mu, treedef, updates)
        nus = _util.leaves_like(what, state.nu, treedef, updates)
        count = state.count + 1
        if not gs:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        mu, nu, out = adam_sweep(gs, mus, nus, count, b1=b1, b2=b2, eps=eps)
        return tree_util.unflatten(treedef, out), ScaleByAdamState(
            count, tree_util.unflatten(treedef, mu), tree_util.unflatten(treedef, nu))

    return GradientTransformation(init, update)


def trace(decay: float, *, nesterov: bool = False) -> GradientTransformation:
    """Momentum as torch.optim.SGD (dampening 0): ``t = decay * t + g``; the update is ``t``,
    or ``g + decay * t`` with ``nesterov``. The first step gives ``t = g``."""
    _util.check_nonneg("trace", "decay", decay, "typical momentum values are 0.9-0.99")

    def init(params):
        return TraceState(trace=_util.zeros_like_tree("sgd/lars momentum", params))

    def update(updates, state, params=None):
        del params
        gs, treedef = tree_util.flatten(updates)
        ts = _util.leaves_like("cfx.optim.trace (grads vs state)", state.trace, treedef, updates)
        if not gs:
            return updates, state
        t = torch._foreach_add(gs, ts, alpha=decay)
        out = torch._foreach_add(gs, t, alpha=decay) if nesterov else t
        return tree_util.unflatten(treedef, out), TraceState(tree_util.unflatten(treedef, t))

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0, *, mask: Any = None) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates.

    ``mask``: a pytree of Python bools with the params' structure, or a function
    ``params -> such a pytree``; decay applies only where it is True (e.g. not to biases and
    norm scales).
    """
    _util.check_nonneg("add_decayed_weights", "weight_decay", weight_decay,
                       "typical values are 0 to 0.1")

    def update(updates, state, params=None):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError("cfx.optim.add_decayed_weights: weight decay needs the params; call "
                             "tx.update(grads, state, params).")
        us, treedef = tree_util.flatten(updates)
        ps = _util.leaves_like("cfx.optim.add_decayed_weights (grads vs params)", params,
                               treedef, updates)
        flags = _util.resolve_mask("cfx.optim.add_decayed_weights", mask, params, len(ps))
        idx = [i for i in range(len(us)) if flags is None or flags[i]]
        if not idx:
            return updates, state
        out = list(us)
        decayed = torch._foreach_add([us[i] for i in idx], [ps[i] for i in idx], alpha=weight_decay)
        for i, d in zip(idx, decayed):
            out[i] = d
        return tree_util.unflatten(treedef, out), state

    return GradientTransformation(init_empty_state, update)


def _layer_norms(xs: list[torch.Tensor], idx: list[int] | None = None, n_leaves: int | None = None,
                 where: str = "cfx.optim") -> torch.Tensor:
    """Per-leaf L2 norms (float32) of leaves ``idx`` (default: all) of a tree, stacked into a
    vector; inside ``cfx.optim.sharded`` each across the shards of its leaf."""
    idx = list(range(len(xs))) if idx is None else idx
    return _util.leaf_norms_global(xs, idx, len(xs) if n_leaves is None else n_leaves, where)


def _scale_leaves(us: list[torch.Tensor], ratios: torch.Tensor) -> list[torch.Tensor]:
    return torch._foreach_mul(us, [r for r in ratios.unbind()])


def scale_by_trust_ratio(*, min_norm: float = 0.0, trust_coefficient: float = 1.0,
                         eps: float = 0.0) -> GradientTransformation:
    """Layer-wise (per leaf) ``u * trust_coefficient * ||p|| / (||u|| + eps)`` as in LAMB;
    the ratio is 1 where either norm is 0. Norms are clamped below at ``min_norm``."""
    _util.check_nonneg("scale_by_trust_ratio", "min_norm", min_norm)
    _util.check_positive("scale_by_trust_ratio", "trust_coefficient", trust_coefficient)
    _util.check_nonneg("scale_by_trust_ratio", "eps", eps)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cfx.optim.scale_by_trust_ratio: needs the params; call "
                             "tx.update(grads, state, params).")
        us, treedef = tree_util.flatten(updates)
        ps = _util.leaves_like("cfx.optim.scale_by_trust_ratio (grads vs params)", params,
                               treedef, updates)
        if not us:
            return updates, state
        p_norm = _layer_norms(ps, where="cfx.optim.scale_by_trust_ratio").clamp_min(min_norm)
        u_norm = _layer_norms(us, where="cfx.optim.scale_by_trust_ratio").clamp_min(min_norm)
        ratio = torch.where((p_norm == 0) | (u_norm == 0), 1.0,
                            trust_coefficient * p_norm / (u_norm + eps))
        return tree_util.unflatten(treedef, _scale_leaves(us, ratio)), state

    return GradientTransformation(init_empty_state, update)


def scale_by_lars(trust_coefficient: float = 1e-3, *, weight_decay: float = 0.0, eps: float = 0.0,
                  mask: Any = None) -> GradientTransformation:
    """LARS's layer-wise step (You et al., 2017): ``lam * (g + wd * p)`` per leaf with the local
    learning rate ``lam = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)``, and ``lam = 1``
    where ``||p||`` or ``||g||`` is 0. Leaves where ``mask`` is False (e.g. biases and norm
    scales) pass through unchanged: no decay, no adaptation.
    """
    _util.check_positive("scale_by_lars", "trust_coefficient", trust_coefficient,
                         "the paper uses 0.001")
    _util.check_nonneg("scale_by_lars", "weight_decay", weight_decay)
    _util.check_nonneg("scale_by_lars", "eps", eps)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cfx.optim.scale_by_lars: needs the params; call "
                             "tx.update(grads, state, params).")
        gs, treedef = tree_util.flatten(updates)
        ps = _util.leaves_like("cfx.optim.scale_by_lars (grads vs params)", params, treedef, updates)
        flags = _util.resolve_mask("cfx.optim.scale_by_lars", mask, params, len(ps))
        idx = [i for i in range(len(gs)) if flags is None or flags[i]]
        if not idx:
            return updates, state
        g_sel, p_sel = [gs[i] for i in idx], [ps[i] for i in idx]
        p_norm = _layer_norms(p_sel, idx, len(gs), "cfx.optim.scale_by_lars")
        g_norm = _layer_norms(g_sel, idx, len(gs), "cfx.optim.scale_by_lars")
        lam = torch.where((p_norm == 0) | (g_norm == 0), 1.0,
                          trust_coefficient * p_norm / (g_norm + weight_decay * p_norm + eps))
        d = torch._foreach_add(g_sel, p_sel, alpha=weight_decay) if weight_decay else g_sel
        out = list(gs)
        for i, x in zip(idx, _scale_leaves(d, lam)):
            out[i] = x
        return tree_util.unflatten(treedef, out), state

    return GradientTransformation(init_empty_state, update)
