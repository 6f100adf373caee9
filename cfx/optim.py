"""Optimizers as composable gradient transformations (optax-shaped).

An optimizer is ``GradientTransformation(init, update)``, a pair of pure functions over pytrees::

    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(1.0),
                         cfx.optim.adamw(cfx.optim.warmup_cosine_decay_schedule(
                             0.0, 6e-4, warmup_steps=100, decay_steps=5000), weight_decay=0.1))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = cfx.optim.apply_updates(params, updates)
    # or, in one sweep where tx allows (adam / adamw, into donated params):
    params, state = cfx.optim.apply_gradients(tx, grads, state, params)

The state is a pytree of tensors (step counts included), so it checkpoints like params; ``update``
never modifies grads, params or the old state. ``sgd``, ``adam`` and ``adamw`` match
``torch.optim`` step for step. For fp16, wrap the optimizer in ``dynamic_loss_scale`` and
differentiate ``scale_loss(loss, state)``. Inside a sharded step, ``with cfx.optim.sharded(...)``
makes global norms (clipping, LAMB / LARS trust ratios) and inf/nan checks span every rank's part.
``accumulate(tx, every)`` steps ``tx`` once per ``every`` micro-batches with their mean gradient
(a batch larger than memory). Freezing is a transform too, optax's: ``masked``, ``multi_transform``,
``set_to_zero`` and ``freeze`` split one tree into trained and frozen leaves by a mask.
"""
from cfx._src.optim.accumulate import AccumulateState, accumulate
from cfx._src.optim.alias import adam, adamw, lamb, lars, sgd
from cfx._src.optim.base import (
    EmptyState,
    init_empty_state,
    GradientTransformation,
    apply_gradients,
    apply_updates,
    chain,
    global_norm,
    identity,
)
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.optim.freezing import MaskedState, MultiTransformState, freeze, masked, multi_transform, set_to_zero
from cfx._src.optim.loss_scale import (
    LossScaleState,
    all_finite,
    dynamic_loss_scale,
    loss_scale,
    scale_loss,
)
from cfx._src.optim.reduction import sharded
from cfx._src.optim.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from cfx._src.optim.transforms import (
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_lars,
    scale_by_learning_rate,
    scale_by_schedule,
    scale_by_trust_ratio,
    trace,
)

__all__ = [
    "AccumulateState", "EmptyState", "GradientTransformation", "LossScaleState", "MaskedState", "MultiTransformState",
    "ScaleByAdamState", "freeze", "masked", "multi_transform", "set_to_zero",
    "ScaleByScheduleState", "TraceState", "accumulate", "adam", "adamw", "add_decayed_weights", "all_finite",
    "apply_gradients", "apply_updates", "chain", "clip_by_global_norm", "constant_schedule", "cosine_decay_schedule",
    "dynamic_loss_scale", "global_norm", "identity", "join_schedules", "lamb", "lars",
    "linear_schedule", "loss_scale", "scale", "scale_by_adam", "scale_by_lars",
    "scale_by_learning_rate", "scale_by_schedule", "scale_by_trust_ratio", "scale_loss", "sgd", "sharded",
    "trace", "warmup_cosine_decay_schedule",
]
