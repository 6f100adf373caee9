"""The loss the training steps differentiate: compute-dtype params, fp32 loss, loss scaling."""
from __future__ import annotations

from cfx._src.transforms.autodiff import value_and_grad


def scaled_loss_grad(model, policy):
    """``grad_fn(params, tokens, targets, key, scale) -> ((loss * scale, loss), grads)``."""
    def scaled_loss(params, tokens, targets, key, scale):
        loss = model.loss(policy.cast_to_compute(params), tokens, targets, key=key)
        return loss * scale, loss
    return value_and_grad(scaled_loss, has_aux=True)
