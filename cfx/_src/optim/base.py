"""The optimizer contract: ``GradientTransformation(init, update)``, ``chain``, ``apply_updates``.

As in optax, an optimizer is a pair of pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)
    # or both at once (one fused sweep where tx supports it): apply_gradients(tx, grads, state, params)

``state`` is an explicit pytree of tensors (NamedTuples), step counts included, so a checkpoint
can save every leaf. ``update`` never writes into ``grads``, ``params`` or the old ``state``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import donation
from cfx._src.core import tree as tree_util
from cfx._src.optim import _util, reduction

PyTree = Any


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)``;
    optionally ``apply(grads, state, params) -> (new params, state)``, the update and
    ``apply_updates`` in one sweep (see ``apply_gradients``)."""

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple[PyTree, PyTree]]
    apply: Callable[..., tuple[PyTree, PyTree]] | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation (no leaves)."""

def init_empty_state(params: PyTree) -> EmptyState:
    """The ``init`` of a stateless transformation."""
    del params
    return EmptyState()


def identity() -> GradientTransformation:
    """Passes updates through unchanged."""

    def update(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init_empty_state, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is the tuple of their states. Has a fused
    ``apply`` when the last transformation has one (the others' updates run first)."""
    for i, t in enumerate(transforms):
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise ValueError(f"cfx.optim.chain: argument {i} is a {type(t).__name__}, not a "
                             "GradientTransformation; build one with e.g. cfx.optim.scale(...).")

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def check(state, params, updates):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"cfx.optim.chain: expected a state tuple of {len(transforms)} entries "
                             f"(one per transformation), got {type(state).__name__}; pass the state "
                             "returned by this optimizer's init or update.")
        if params is not None:
            tree_util.check_same_structure("cfx.optim update (params vs grads)", params, updates)

    def run(ts, updates, states, params):
        new_state = []
        for t, s in zip(ts, states):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, new_state

    def update(updates, state, params=None):
        check(state, params, updates)
        updates, new_state = run(transforms, updates, state, params)
        return updates, tuple(new_state)

    if not transforms or getattr(transforms[-1], "apply", None) is None:
        return GradientTransformation(init, update)

    def apply(grads, state, params):
        check(state, params, grads)
        updates, new_state = run(transforms[:-1], grads, state[:-1], params)
        new_params, last = transforms[-1].apply(updates, state[-1], params)
        return new_params, tuple(new_state) + (last,)

    return GradientTransformation(init, update, apply)


def apply_gradients(tx: GradientTransformation, grads: PyTree, state: PyTree,
                    params: PyTree) -> tuple[PyTree, PyTree]:
    """``(new params, new state)``: ``tx.update`` then ``apply_updates``, in one sweep where ``tx``
    has a fused ``apply`` (``adam`` / ``adamw``, last in a ``chain``): with donated params
    (``cfx.jit(..., donate_argnums=...)``) it writes the new params straight into them, without
    an updates tree -- one pass and one model-sized buffer fewer per step. The same numbers up to
    float rounding either way."""
    if getattr(tx, "apply", None) is not None:
        return tx.apply(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """New params ``p + u`` leafwise, with ``u`` cast to ``p``'s dtype (added in place into
    params whose buffers the caller donated, see ``cfx._src.core.donation``)."""
    ps, treedef = tree_util.flatten(params)
    us = _util.leaves_like("cfx.optim.apply_updates (params vs updates)", updates, treedef, params)
    if not ps:
        return params
    us = [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(ps, us)]
    if donation.all_donated(ps):
        torch._foreach_add_(ps, us)
        return params
    return tree_util.unflatten(treedef, torch._foreach_add(ps, us))


def global_norm(tree: PyTree) -> torch.Tensor:
    """``sqrt(sum of squares)`` over every tensor leaf, accumulated in float32 (0-d tensor);
    inside ``cfx.optim.sharded`` over every rank's part of the tree."""
    leaves = tree_util.leaves(tree)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not idx:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack(_util.leaf_norms([leaves[i] for i in idx]))
    if not reduction.is_sharded():
        return torch.linalg.vector_norm(norms)
    sq = reduction.leaf_sq_sums(norms.square(), idx, len(leaves), "cfx.optim.global_norm", total=True).sum()
    return reduction.add_rest(sq).sqrt()
