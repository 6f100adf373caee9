"""Weights a model reads and never trains (a LoRA base, a frozen encoder), and how a Plan places them.

A model with frozen weights holds them beside its params and implements two hooks, which
``cfx.parallel.Plan`` reads (``plan/frozen.py``):

    model.frozen               # its frozen weights as held now: a tree, or placed trees
    model.place_frozen(placer) # the same model over its frozen weights placed by ``placer``

A ``placer`` (``plan.frozen.Placer``) keeps a tree as the plan keeps the params: ``placer.place(tree,
specs=None, stage=None)`` returns a **placed tree** -- anything with ``gathered(device)``, a context
giving the tree (this rank's block of it under ``specs``) on ``device`` for its body, and
``nbytes(rank)`` -- and ``placer.stages`` lists the blocks each pipe stage runs (None: no pipe axis).
The model knows nothing of where they are: it reads them through ``gathered`` around each use, and
they are never differentiated nor given optimizer state. A program's
``TrainState.frozen`` is ``model.frozen`` after the plan placed it.

``HeldWhole`` is the placed tree where nothing moves it: the whole tree, copied once to each device
it is read on. Inside ``whole()`` every pipe rank runs every layer (a model's ``apply`` / ``loss``
outside the pipeline's schedule), so a placed tree held by one stage is shared over ``pipe``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from cfx._src.core import context
from cfx._src.core import tree as tree_util
from cfx._src.mesh.layout import block_of
from cfx._src.mesh.spec import P, is_spec
from cfx._src.nn.lora_weight import is_weight_node
from cfx._src.precision.quant import QuantizedWeight

_whole: context.Var[bool] = context.Var("cfx_frozen_whole_model", False)


@contextlib.contextmanager
def whole():
    """Every pipe rank runs every layer inside (module doc): staged frozen trees are shared over ``pipe``."""
    token = _whole.set(True)
    try:
        yield
    finally:
        _whole.reset(token)


def in_whole() -> bool:
    """Whether a ``whole()`` block is active (a placed tree reads it in ``gathered``)."""
    return _whole.get()


def is_placed(tree: Any) -> bool:
    """Whether ``tree`` is a placed tree (module doc) rather than a tree of tensors."""
    return callable(getattr(tree, "gathered", None)) and callable(getattr(tree, "nbytes", None))


class HeldWhole:
    """A frozen tree held whole, copied once to each device it is read on (module doc)."""

    def __init__(self, tree: Any):
        self.tree, self.copies = tree, {}

    @contextlib.contextmanager
    def gathered(self, device: torch.device):
        if device not in self.copies:  # x.to(its own device) is x: no copy where the tree already is
            self.copies[device] = tree_util.map(lambda x: x.to(device), self.tree)
        yield self.copies[device]

    def nbytes(self, rank: int) -> int:
        del rank
        return tree_util.nbytes(self.tree)


def block_at(tree: Any, specs: Any, mesh: Any, coords: dict) -> Any:
    """The block of the global ``tree`` that the rank at ``coords`` holds under ``specs`` (a pytree of
    ``P`` shaped like it, weights as single leaves; None: the whole tree): views, no copies. An int8
    weight's ``q`` splits as its spec says, its per-column ``scale`` with the output dim."""
    if specs is None:
        return tree
    leaves, treedef = tree_util.flatten(tree, is_leaf=is_weight_node)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))

    def local(x: Any, spec: P) -> Any:
        if isinstance(x, QuantizedWeight):
            out = P(*tuple(spec)[1:2])  # (out,) scales split with the weight's columns
            return QuantizedWeight(block_of(x.q, spec, mesh, coords), block_of(x.scale, out, mesh, coords))
        return block_of(x, spec, mesh, coords) if isinstance(x, torch.Tensor) else x
    return tree_util.unflatten(treedef, [local(x, s) for x, s in zip(leaves, spec_leaves)])
