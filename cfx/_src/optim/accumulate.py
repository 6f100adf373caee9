"""Gradient accumulation: ``accumulate(tx, every)`` steps ``tx`` once per ``every`` micro-batches
(optax's ``MultiSteps``).

A batch too big for memory is cut into ``every`` equal micro-batches; each call adds one
micro-batch's gradient to a running sum, and every ``every``-th call hands their mean to ``tx``::

    tx = cfx.optim.accumulate(cfx.optim.lamb(schedule), every=4)  # 4 micro-batches of 1024: batch 4096
    for x, y in micro_batches:
        _, grads = cfx.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)          # zeros but on every 4th call
        params = cfx.optim.apply_updates(params, updates)

With a mean loss per micro-batch, the mean of the ``every`` gradients is the gradient of the mean
loss over the whole batch, so the step is the big batch's step (up to float rounding) -- trust
ratios, moments, weight decay and schedules included: ``tx`` sees one call per big batch and its
schedules count big-batch steps.

The choice between "keep summing" and "step" is made on device with ``torch.where`` (as
``dynamic_loss_scale`` skips a step): no host sync, so a step under ``cfx.jit`` compiles as one
graph. The price: ``tx.update`` runs on every call and its result is kept on every ``every``-th
(an optimizer pass per micro-batch; the forward and backward of a micro-batch usually cost far
more). Sums are kept in float32 (or the grads' dtype, if wider).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim import _util
from cfx._src.optim.base import GradientTransformation

PyTree = Any


class AccumulateState(NamedTuple):
    count: torch.Tensor  # 0-d int32: micro-batches summed since the last step of the inner tx
    acc: PyTree          # the sum of their gradients, like params (float32 or wider)
    inner: PyTree        # the inner transformation's state


def accumulate(tx: GradientTransformation, every: int) -> GradientTransformation:
    """``tx`` stepped with the mean of ``every`` successive gradients; zero updates in between
    (module doc)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise ValueError(f"cfx.optim.accumulate: tx is a {type(tx).__name__}, not a "
                         "GradientTransformation; pass e.g. cfx.optim.lamb(1e-3).")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"cfx.optim.accumulate: every={every!r} must be an int >= 1, the number of "
                         "micro-batches per step (batch size / micro-batch size).")

    def init(params):
        for path, p in tree_util.flatten_with_path(params)[0]:
            if not p.is_floating_point():
                raise ValueError(f"cfx.optim.accumulate: param {path or '<root>'!r} is {p.dtype}; "
                                 "gradients are summed in a floating dtype. Keep integer state out of "
                                 "the tree the optimizer updates.")
        acc = tree_util.map(lambda p: torch.zeros_like(p, dtype=_acc_dtype(p.dtype)), params)
        return AccumulateState(count=_util.zero_count(params), acc=acc, inner=tx.init(params))

    def update(updates, state, params=None):
        if not isinstance(state, AccumulateState):
            raise ValueError(f"cfx.optim.accumulate: expected an AccumulateState, got "
                             f"{type(state).__name__}; pass the state returned by this optimizer's "
                             "init or update.")
        gs, treedef = tree_util.flatten(updates)
        accs = _util.leaves_like("cfx.optim.accumulate (grads vs state)", state.acc, treedef, updates)
        count = state.count + 1
        step = count >= every  # 0-d bool: this call completes a batch
        summed = [a + g.to(a.dtype) for a, g in zip(accs, gs)]
        mean = torch._foreach_div(summed, float(every)) if summed else []
        inner_updates, inner_state = tx.update(tree_util.unflatten(treedef, mean), state.inner, params)
        # keep the inner step only on a batch's last call (torch.where: no host sync, nans dropped)
        out = tree_util.map(lambda u, g: torch.where(step, u, 0.0).to(g.dtype), inner_updates, updates)
        new_inner = tree_util.map(lambda new, old: new if new is old else torch.where(step, new, old),
                                  inner_state, state.inner)
        new_acc = tree_util.unflatten(treedef, [torch.where(step, 0.0, s) for s in summed])
        return out, AccumulateState(torch.where(step, 0, count).to(torch.int32), new_acc, new_inner)

    return GradientTransformation(init, update)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)
