"""Gradient clipping."""
from __future__ import annotations

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim import _util
from cfx._src.optim.base import GradientTransformation, global_norm, init_empty_state


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (global_norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` (one factor for the whole tree, so directions keep)."""
    _util.check_positive("clip_by_global_norm", "max_norm", max_norm, "typical values are 0.5-1.0")

    def update(updates, state, params=None):
        del params
        us, treedef = tree_util.flatten(updates)
        if not us:
            return updates, state
        coef = torch.clamp(max_norm / (global_norm(us) + 1e-6), max=1.0)
        return tree_util.unflatten(treedef, torch._foreach_mul(us, coef)), state

    return GradientTransformation(init_empty_state, update)
