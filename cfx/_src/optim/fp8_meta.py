"""Delayed scaling's ``Fp8Meta`` (``cfx._src.nn.fp8_delayed``) kept in an optimizer's state: checkpoints hold
it with the rest of the state, and a resumed run scales as the run it continues."""
from __future__ import annotations

from typing import Any

from cfx._src.core import tree as tree_util
from cfx._src.nn.fp8_delayed import DelayedScaling, Fp8Meta, init_meta
from cfx._src.optim.base import GradientTransformation


def meta_state(slots: int, cfg: DelayedScaling) -> GradientTransformation:
    """A transformation whose state is the ``Fp8Meta`` of ``slots`` slots and whose updates pass through: chain
    it in front of an optimizer (``cfx.optim.chain(meta_state(...), adamw)``) to keep the meta in its state."""
    def init(params):
        del params
        return init_meta(slots, cfg)

    def update(updates, state, params=None):
        del params
        return updates, state
    return GradientTransformation(init, update)


def _is_meta(x: Any) -> bool:
    return isinstance(x, Fp8Meta)


def find_meta(opt_state: Any) -> Fp8Meta:
    """The one ``Fp8Meta`` in an optimizer's state."""
    found = [x for x in tree_util.leaves(opt_state, is_leaf=_is_meta) if _is_meta(x)]
    if len(found) != 1:
        raise ValueError(f"delayed scaling: found {len(found)} Fp8Meta in the optimizer's state, need exactly one; "
                         "chain cfx.amp.fp8_meta_state(...) in front of the optimizer once.")
    return found[0]


def replace_meta(opt_state: Any, meta: Fp8Meta) -> Any:
    """``opt_state`` with its ``Fp8Meta`` replaced by ``meta``."""
    return tree_util.map(lambda x: meta if _is_meta(x) else x, opt_state, is_leaf=_is_meta)
