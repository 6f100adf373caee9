"""``float8(model, recipe)``: a model whose blocks' Linears run their matmuls in float8 (``fp8.py``).

A layer transform, as ``cfx.remat`` and ``cfx.zero.gathered`` are: every block but the first (by default;
``where=`` picks others) becomes a ``Float8Layer`` with the same ``init`` / ``apply`` / ``axes``, whose
``apply`` hands each Linear weight the float8 GEMM takes (``fp8.takes``: ``w`` of two dims, multiples of 16)
to the block as a ``Float8Weight``. torchtitan's rule, in cfx's names: the first block, the embeddings, the
norms and the head stay in high precision. The params stay what they are -- plain tensors, stored, gathered by ZeRO-3, streamed by
offload, split over pipeline stages as any others -- so every strategy that runs a block's ``apply`` on
its weights runs the float8 Linears.

Under a mesh, ``rules`` (logical axis -> mesh axes, the plan's) says which axes split each weight's two
dims and ``tokens`` which split the batch's rows, so each rank scales its pieces with the amax one device
takes (``fp8.Split``)::

    model = cfx.amp.float8(model, "rowwise")                   # one device
    loss = model.loss(cfx.amp.policy("fp8:rowwise").cast_to_compute(params), tokens, targets)
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Mapping

import torch

from cfx._src.core import random, tree as tree_util
from cfx._src.nn.fp8 import Float8Gathered, Float8Weight, Split, recipe as check_recipe, takes
from cfx._src.nn.fp8_delayed import DelayedScaling, Slots
from cfx._src.transforms.shapes import eval_shape


@dataclasses.dataclass(frozen=True)
class Float8Layer:
    """``layer`` whose Linear weights at ``linears`` (``(relative path, Split)`` pairs) run in float8 by
    ``recipe``; same ``init`` / ``apply`` / ``axes`` as ``layer`` (module doc). ``slots``: under delayed scaling
    each Linear's first slot in the meta (``fp8_delayed``), else None (each cast scales by its own amax)."""

    layer: Any
    recipe: str
    linears: tuple[tuple[str, Split], ...]
    slots: tuple[int, ...] | None = None
    gather: bool = False  # under ZeRO-3, its weights all-gathered in float8 (``cfx.zero.gathered`` asks)

    def init(self, key):
        return self.layer.init(key)

    def axes(self):
        return self.layer.axes()

    def marked(self, params: Any) -> Any:
        """``params`` with the weights at ``linears`` as ``Float8Weight`` nodes."""
        at = {path: (split, None if self.slots is None else Slots(base))
              for (path, split), base in zip(self.linears, self.slots or [None] * len(self.linears))}
        return tree_util.map_with_path(
            lambda path, x: Float8Weight(x, self.recipe, *at[path]) if path in at else x, params)

    def apply(self, params, *args, **kwargs):
        return self.layer.apply(self.marked(params), *args, **kwargs)

    @property
    def gathered_in_fp8(self) -> dict[str, Split]:
        """The weights a ZeRO-3 gather around this layer casts to e4m3 before it gathers them (``gather``), with
        the axes their pieces split over besides ZeRO's."""
        return dict(self.linears) if self.gather else {}

    def gathered_weight(self, path: str, w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> Float8Gathered:
        """The weight at ``path`` as the float8 all-gather delivers it: cast already (``w8``, ``scale``); ``w`` its
        stand-in, through which its gradient goes back."""
        return Float8Gathered(w, self.recipe, dict(self.linears)[path], None, w8, scale)

    def apply_with_stats(self, params, *args, **kwargs):
        """``layer.apply_with_stats`` (an MoE block's) on the marked params."""
        return self.layer.apply_with_stats(self.marked(params), *args, **kwargs)


def _mesh_axes(rules: Mapping[str, Any], name: str | None) -> tuple[str, ...]:
    axes = rules.get(name) if name is not None else None
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def linears_of(layer: Any, rules: Mapping[str, Any] | None = None, tokens: tuple[str, ...] = ()
               ) -> tuple[tuple[str, Split], ...]:
    """The ``(path, Split)`` of each Linear weight of ``layer`` the float8 GEMM takes (``fp8.takes``), the mesh
    axes of its two dims from its logical axes (``layer.axes()``) through ``rules`` (``cfx.parallel.Rules``'
    mapping), the rows' from ``tokens``."""
    shapes = eval_shape(layer.init, random.key(0))
    logical = dict(tree_util.flatten_with_path(layer.axes(), is_leaf=tree_util.is_axes_leaf)[0])
    rules = rules or {}
    out = []
    for path, leaf in tree_util.flatten_with_path(shapes)[0]:
        if takes(path.rpartition(".")[2], tuple(leaf.shape)):
            k, n = (tuple(logical.get(path, ())) + (None, None))[:2]
            split = Split(tuple(tokens), _mesh_axes(rules, k), _mesh_axes(rules, n))
            out.append((path, split))
    return tuple(out)


def first_block_stays(index: int, path: str) -> bool:
    """torchtitan's rule: every block's Linears but the first block's (the embeddings and head are no blocks)."""
    return index > 0


def float8(model: Any, recipe: str = "tensorwise", *, rules: Mapping[str, Any] | None = None,
           tokens: tuple[str, ...] = (), scaling: DelayedScaling | None = None, gather: bool = False,
           where: Callable[[int, str], bool] = first_block_stays) -> Any:
    """``model`` with its blocks' Linears run in float8 by ``recipe``, each block with one a ``Float8Layer`` (module
    doc): those ``where(block index, path in the block)`` picks (default: all but the first block's), of the ones
    the float8 GEMM takes (``fp8.takes``: dims multiples of 16). ``rules`` and
    ``tokens``: how a mesh splits the weights and the batch (a Plan passes its own). ``scaling``: delayed scaling
    (``fp8_delayed``; per tensor, so ``recipe`` tensorwise), each Linear given three slots in block order --
    ``slots_of(model)`` in all, the meta's size. ``gather``: ZeRO-3 all-gathers the Linears' weights in float8
    (their e4m3 cast and scale, the one the tensorwise recipe takes; ``Float8Layer.gathered_in_fp8``)."""
    check_recipe(recipe)
    if gather and (recipe != "tensorwise" or scaling is not None):
        raise ValueError("cfx.amp.float8: gather=True all-gathers each weight's e4m3 cast by its own amax, the cast "
                         "of the tensorwise recipe with dynamic scaling; use recipe='tensorwise' and no delayed scaling.")
    if scaling is not None and recipe != "tensorwise":
        raise ValueError(f"cfx.amp.float8: delayed scaling (Transformer Engine's) scales each tensor whole; recipe "
                         f"{recipe!r} scales rows. Use recipe='tensorwise' with it, or dynamic scaling.")
    if not isinstance(getattr(model, "blocks", None), tuple):
        raise ValueError(f"cfx.amp.float8: {type(model).__name__} has no tuple of blocks (the parts protocol's "
                         "`blocks`) whose Linears would run in float8; wrap a layer with "
                         "Float8Layer(layer, recipe, linears_of(layer)) instead.")
    index, slot = itertools.count(), itertools.count(0, 3)

    def convert(block: Any) -> Any:
        i = next(index)
        linears = tuple((p, s) for p, s in linears_of(block, rules, tokens) if where(i, p))
        if not linears:
            return block
        slots = None if scaling is None else tuple(next(slot) for _ in linears)
        return Float8Layer(block, recipe, linears, slots, gather)

    return model.map_blocks(convert)


def slots_of(model: Any) -> int:
    """How many delayed-scaling slots a ``float8(..., scaling=...)`` model's Linears take (3 each)."""
    return sum(3 * len(b.linears) for b in getattr(model, "blocks", ())
               if isinstance(b, Float8Layer) and b.slots is not None)
