"""Dynamic loss scaling for fp16 training, with ``torch.amp.GradScaler``'s semantics.

fp16 gradients underflow; multiplying the loss by a large scale ``S`` keeps them representable.
The scaler is a transformation wrapping the optimizer, and its state (scale, good-step tracker,
skipped-step count, the inner optimizer's state) is an ordinary pytree::

    tx = cfx.optim.dynamic_loss_scale(cfx.optim.adamw(3e-4))
    state = tx.init(params)
    for batch in data:
        grads = cfx.grad(lambda p: cfx.optim.scale_loss(loss_fn(p, batch), state))(params)
        updates, state = tx.update(grads, state, params)   # takes the SCALED grads
        params = cfx.optim.apply_updates(params, updates)

``update`` unscales the grads in float32 and checks them. If all are finite, the inner optimizer
steps; otherwise the updates are zero and the inner state is kept (selected on device, no host
sync). Then, as ``torch._amp_update_scale_``: on inf/nan ``scale *= backoff_factor`` and the
tracker resets; else the tracker counts up and, on reaching ``growth_interval``,
``scale *= growth_factor`` (unless that overflows float32) and resets.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim import _util, reduction
from cfx._src.optim.base import GradientTransformation

PyTree = Any


class LossScaleState(NamedTuple):
    scale: torch.Tensor           # 0-d float32: multiply the loss by this
    growth_tracker: torch.Tensor  # 0-d int32: finite steps since the scale last changed
    skipped: torch.Tensor         # 0-d int32: steps skipped for inf/nan grads so far
    inner_state: PyTree           # the wrapped optimizer's state


def all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-d bool tensor: True when no floating-point leaf holds an inf or a nan."""
    xs = [x for x in tree_util.leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not xs:
        return torch.ones((), dtype=torch.bool)
    flags = [torch.isfinite(x).all() for x in xs]
    ok = torch.stack([f.to(xs[0].device, non_blocking=True) for f in flags]).all()
    if reduction.is_sharded():  # an inf/nan on any rank counts everywhere
        ok = reduction.count_everywhere((~ok).to(torch.float32)) == 0
    return ok


def _unscale_and_check(gs: list[torch.Tensor], scale: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                            torch.Tensor]:
    """float32 copies of ``gs`` divided by ``scale``, and a 0-d bool "all finite" on scale's device.

    Uses GradScaler's own fused kernel (multiply + inf/nan check in one pass), on fresh copies.
    """
    inv_scale = scale.double().reciprocal().float()  # as GradScaler
    out = [g.to(torch.float32, copy=True) for g in gs]
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in out:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(device))
        found_inf = found_inf + found.to(scale.device)
    return out, reduction.count_everywhere(found_inf) == 0


def dynamic_loss_scale(inner: GradientTransformation, *, init_scale: float = 2.0 ** 16,
                       growth_factor: float = 2.0, backoff_factor: float = 0.5,
                       growth_interval: int = 2000) -> GradientTransformation:
    """Wraps ``inner`` so that its ``update`` takes grads of ``loss * loss_scale(state)``."""
    fn = "dynamic_loss_scale"
    _util.check_positive(fn, "init_scale", init_scale, "the usual value is 2**16")
    if not isinstance(growth_factor, numbers.Real) or not growth_factor > 1.0:
        raise ValueError(f"cfx.optim.{fn}: growth_factor={growth_factor!r} must be > 1 "
                         "(the usual value is 2.0).")
    if not isinstance(backoff_factor, numbers.Real) or not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"cfx.optim.{fn}: backoff_factor={backoff_factor!r} must be in (0, 1) "
                         "(the usual value is 0.5).")
    if not isinstance(growth_interval, numbers.Integral) or isinstance(growth_interval, bool) \
            or growth_interval < 1:
        raise ValueError(f"cfx.optim.{fn}: growth_interval={growth_interval!r} must be an integer "
                         ">= 1 (the usual value is 2000 steps).")

    def init(params):
        device = _util.first_device(params)
        return LossScaleState(
            scale=torch.full((), float(init_scale), dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            skipped=torch.zeros((), dtype=torch.int32, device=device),
            inner_state=inner.init(params))

    def update(updates, state, params=None):
        gs, treedef = tree_util.flatten(updates)
        unscaled, ok = _unscale_and_check(gs, state.scale)
        new_updates, new_inner = inner.update(tree_util.unflatten(treedef, unscaled),
                                              state.inner_state, params)
        # Skip the step on inf/nan: zero updates, old inner state (torch.where drops the nans).
        new_updates = tree_util.map(lambda u: torch.where(ok, u, 0.0), new_updates)
        new_inner = tree_util.map(lambda new, old: new if new is old else torch.where(ok, new, old),
                                  new_inner, state.inner_state)
        return new_updates, _next_scale(state, ok, new_inner)

    def _next_scale(state, ok, new_inner):
        scale = state.scale
        tracker = state.growth_tracker + 1
        grow = ok & (tracker == growth_interval)
        grown = (scale.double() * growth_factor).float()
        scale = torch.where(grow & torch.isfinite(grown), grown, scale)
        scale = torch.where(ok, scale, (state.scale.double() * backoff_factor).float())
        tracker = torch.where(ok & ~grow, tracker, 0)
        return LossScaleState(scale, tracker, state.skipped + (~ok).to(torch.int32), new_inner)

    return GradientTransformation(init, update)


def loss_scale(state: PyTree) -> torch.Tensor:
    """The current scale (0-d float32) in ``state``, or in the one LossScaleState inside it."""
    if isinstance(state, LossScaleState):
        return state.scale
    found = [s for s in tree_util.leaves(state, is_leaf=lambda x: isinstance(x, LossScaleState))
             if isinstance(s, LossScaleState)]
    if len(found) != 1:
        raise ValueError(f"cfx.optim.loss_scale: found {len(found)} LossScaleState in the state, "
                         "need exactly one; wrap the optimizer once with "
                         "cfx.optim.dynamic_loss_scale(...) and pass its state.")
    return found[0].scale


def scale_loss(loss: torch.Tensor, state: PyTree) -> torch.Tensor:
    """``loss * loss_scale(state)``: differentiate this, then pass the grads to ``update``."""
    return loss * loss_scale(state).to(loss.device, non_blocking=True)
