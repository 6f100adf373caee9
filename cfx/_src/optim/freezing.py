"""Freezing as an optimizer transform, optax's way: a tree of trainable and frozen leaves is one
tree split by a mask, never two storage classes (equinox's ``partition`` / optax's ``masked``).

    tx = cfx.optim.multi_transform({"train": cfx.optim.adamw(1e-3), "frozen": cfx.optim.set_to_zero()},
                                   lambda params: cfx.tree.map(lambda x: "train" if x.dim() > 1 else "frozen", params))

* ``set_to_zero()``: every update zero; no state.
* ``masked(inner, mask)``: ``inner`` on the leaves where ``mask`` (a tree of bools shaped like the
  params, or a function of the params giving one) is True; the other leaves' updates pass through
  unchanged, as optax's. ``inner`` sees a tree whose unmasked leaves are ``None``, so its state
  holds the masked leaves' alone (an AdamW over a tenth of the leaves keeps a tenth of the moments).
* ``multi_transform(transforms, labels)``: each leaf's update by the transformation its label names
  (``labels``: a tree of strings shaped like the params, or a function of them); every label must
  have a transformation and every transformation a leaf.
* ``freeze(mask)``: the leaves where ``mask`` is True never change (their updates zero), the others'
  pass through: ``chain(freeze(mask), adamw(...))`` freezes what ``mask`` picks, though the AdamW then
  still keeps moments for the frozen leaves -- ``multi_transform`` with ``set_to_zero`` does not.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim.base import GradientTransformation, init_empty_state

PyTree = Any


def set_to_zero() -> GradientTransformation:
    """Every update zero (optax's ``set_to_zero``): a frozen part's transformation."""

    def update(updates, state, params=None):
        del params
        return tree_util.map(torch.zeros_like, updates), state

    return GradientTransformation(init_empty_state, update)


class MaskedState(NamedTuple):
    inner_state: Any


def _resolve(what: str, tree_or_fn: Any, params: PyTree, kind: type) -> list:
    """The leaves of a mask / label tree (or of ``fn(params)``), one per leaf of ``params``, each a ``kind``."""
    tree = tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn
    leaves, treedef = tree_util.flatten(params)
    marks = tree_util.leaves(tree)
    if len(marks) != len(leaves) or tree_util.structure(tree) != treedef:
        tree_util.check_same_structure(f"cfx.optim.{what}", params, tree)
        raise ValueError(f"cfx.optim.{what}: the {kind.__name__} tree has {len(marks)} leaves for the params' "
                         f"{len(leaves)}; give one per leaf, shaped like the params (or a function of them).")
    bad = [m for m in marks if not isinstance(m, kind)]
    if bad:
        raise ValueError(f"cfx.optim.{what}: expected a {kind.__name__} per leaf, got {type(bad[0]).__name__} "
                         f"({bad[0]!r}).")
    return marks


def _select(tree: PyTree, keep: list[bool]) -> PyTree:
    """``tree`` with its leaves where ``keep`` is False made ``None`` (a node of no leaves)."""
    leaves, treedef = tree_util.flatten(tree)
    return tree_util.unflatten(treedef, [x if k else None for x, k in zip(leaves, keep)])


def _merge(base: PyTree, part: PyTree, keep: list[bool]) -> PyTree:
    """``base`` with its leaves where ``keep`` is True taken from ``part`` (shaped like ``_select``'s)."""
    leaves, treedef = tree_util.flatten(base)
    got = iter(tree_util.leaves(part))
    return tree_util.unflatten(treedef, [next(got) if k else x for x, k in zip(leaves, keep)])


def masked(inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]) -> GradientTransformation:
    """``inner`` on the leaves ``mask`` picks; the others' updates unchanged (module doc)."""

    def init(params):
        keep = _resolve("masked", mask, params, bool)
        return MaskedState(inner.init(_select(params, keep)))

    def update(updates, state, params=None):
        keep = _resolve("masked", mask, updates if params is None else params, bool)
        part, inner_state = inner.update(_select(updates, keep), state.inner_state,
                                         None if params is None else _select(params, keep))
        return _merge(updates, part, keep), MaskedState(inner_state)

    return GradientTransformation(init, update)


class MultiTransformState(NamedTuple):
    inner_states: dict


def multi_transform(transforms: Mapping[str, GradientTransformation],
                    labels: PyTree | Callable[[PyTree], PyTree]) -> GradientTransformation:
    """Each leaf's update by ``transforms[its label]`` (module doc)."""
    transforms = dict(transforms)

    def masks(params) -> dict[str, list[bool]]:
        marks = _resolve("multi_transform", labels, params, str)
        unknown = sorted(set(marks) - set(transforms))
        if unknown:
            raise ValueError(f"cfx.optim.multi_transform: labels {unknown} have no transformation; the "
                             f"transformations are {sorted(transforms)}.")
        unused = sorted(set(transforms) - set(marks))
        if unused:
            raise ValueError(f"cfx.optim.multi_transform: no leaf is labelled {unused}; drop those "
                             "transformations or label leaves with them.")
        return {name: [m == name for m in marks] for name in transforms}

    def init(params):
        return MultiTransformState({name: masked(transforms[name], _as_mask(keep)).init(params)
                                    for name, keep in masks(params).items()})

    def update(updates, state, params=None):
        new, out = {}, updates
        for name, keep in masks(updates if params is None else params).items():
            part, new[name] = masked(transforms[name], _as_mask(keep)).update(updates, state.inner_states[name], params)
            out = _merge(out, _select(part, keep), keep)
        return out, MultiTransformState(new)

    return GradientTransformation(init, update)


def _as_mask(keep: list[bool]) -> Callable[[PyTree], PyTree]:
    """A mask function giving ``keep`` shaped like the params it is given."""
    return lambda params: tree_util.unflatten(tree_util.structure(params), list(keep))


def freeze(mask: PyTree | Callable[[PyTree], PyTree]) -> GradientTransformation:
    """The leaves ``mask`` picks get zero updates; the others pass through (module doc)."""
    return masked(set_to_zero(), mask)
