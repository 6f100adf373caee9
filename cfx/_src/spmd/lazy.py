"""Lazy initialisation: record what a function would compute, then compute one output at a time.

``record(fn, *args)`` runs ``fn`` under a dispatch mode in which every *large* tensor (more than
``SMALL`` elements) is a meta tensor standing for a recipe: the aten op that makes it and that
op's arguments (other recipes or real constants). Small tensors (keys, counters, norms' scales)
are computed for real, so code that reads values (``int(key)``) still works. ``materialise``
replays one recipe on real tensors, so a caller can build a model's parameters leaf by leaf and
keep only the slices it needs (Colossal-AI's ``LazyInitContext``). Replays execute the same aten
ops with the same arguments -- random draws restart from the generator state saved when the draw
was recorded -- so values equal the eager run's bit for bit.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

SMALL = 4096  # elements: tensors up to this size are computed eagerly while recording


@dataclasses.dataclass(eq=False)
class Recipe:
    func: Any
    args: tuple
    kwargs: dict
    index: int | None          # which output, for ops returning several tensors
    generator_state: torch.Tensor | None = None
    inplace: bool = False


class _Ref:
    """A recipe's place in another recipe's arguments."""

    __slots__ = ("recipe",)

    def __init__(self, recipe: Recipe):
        self.recipe = recipe


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.recipes: dict[int, Recipe] = {}      # id(meta tensor) -> recipe
        self.keep: list[torch.Tensor] = []        # the meta tensors (so ids stay unique)
        self.pending: dict[int, tuple] = {}       # id(generator) -> (generator, recipe) not yet advanced

    def recipe_of(self, x: Any) -> Recipe | None:
        return self.recipes.get(id(x)) if isinstance(x, torch.Tensor) and x.device.type == "meta" else None

    def _advance(self, g: torch.Generator) -> None:
        """Bring ``g`` to the state after the lazy draw recorded on it (by drawing on a copy)."""
        entry = self.pending.pop(id(g), None)
        if entry is not None:
            _, recipe = entry
            copy = torch.Generator(device=g.device)
            copy.set_state(recipe.generator_state)
            _replay(recipe, {}, generator=copy)
            g.set_state(copy.get_state())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = kwargs.get("generator")
        if g is None and torch.Tag.nondeterministic_seeded in func.tags:
            raise ValueError(f"cfx.init_sharded: the init function draws from torch's global RNG ({func}); "
                             "draw with cfx.random and an explicit key so every process gets the same values.")
        if g is not None:
            self._advance(g)
        flat, spec = tree_flatten((args, kwargs))
        lazy = any(self.recipe_of(x) is not None for x in flat)
        tensors = any(isinstance(x, torch.Tensor) for x in flat)
        if func is torch.ops.aten._local_scalar_dense.default and lazy:
            raise ValueError("cfx.init_sharded: the init function reads the value of a large tensor "
                             f"(more than {SMALL} elements) while it is being built; compute such "
                             "values from small tensors (keys, shapes) instead.")
        if not lazy and tensors:
            return func(*args, **kwargs)
        meta_out = self._meta(func, flat, spec)
        outs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
        if not lazy and all(not isinstance(o, torch.Tensor) or o.numel() <= SMALL for o in outs):
            return func(*args, **kwargs)  # a small factory: compute it now
        ref_args = tree_unflatten([_Ref(self.recipes[id(x)]) if self.recipe_of(x) is not None else x
                                   for x in flat], spec)
        state = g.get_state() if g is not None else None
        inplace = func._schema.is_mutable if hasattr(func, "_schema") else False
        if inplace and flat and isinstance(flat[0], torch.Tensor) and self.recipe_of(flat[0]) is None:
            raise ValueError(f"cfx.init_sharded: {func} writes a large lazily-built value into a small eager "
                             "tensor; build the result out of place (x = x + y) in the init function.")
        if inplace and flat and isinstance(flat[0], torch.Tensor) and flat[0]._is_view():
            raise ValueError(f"cfx.init_sharded: {func} writes in place into a view (a slice, a row) of a large "
                             "lazily-built tensor, which would not reach the tensor itself; build the result out "
                             "of place in the init function (torch.where, torch.cat, x * mask).")
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            r = Recipe(func, ref_args[0], ref_args[1], i if isinstance(meta_out, (tuple, list)) else None,
                       state, inplace)
            if inplace and flat and isinstance(flat[0], torch.Tensor):
                o = flat[0]  # the mutated tensor now stands for the new recipe
            self.recipes[id(o)] = r
            self.keep.append(o)
            if g is not None:
                self.pending[id(g)] = (g, r)
        return meta_out

    @staticmethod
    def _meta(func, flat, spec):
        def to_meta(x):
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                return x.to("meta")
            if isinstance(x, torch.Generator):
                return None
            return x
        margs, mkwargs = tree_unflatten([to_meta(x) for x in flat], spec)
        if "device" in mkwargs:
            mkwargs = dict(mkwargs, device=torch.device("meta"))
        return func(*margs, **mkwargs)


def _replay(recipe: Recipe, memo: dict, generator: torch.Generator | None = None) -> torch.Tensor:
    hit = memo.get(id(recipe))
    if hit is not None:
        return hit

    def value(x):
        if isinstance(x, _Ref):
            v = _replay(x.recipe, memo)
            return v.clone() if recipe.inplace and x is recipe.args[0] else v
        return x
    args = tree_map(value, recipe.args, is_leaf=lambda x: isinstance(x, _Ref))
    kwargs = tree_map(value, recipe.kwargs, is_leaf=lambda x: isinstance(x, _Ref))
    if recipe.generator_state is not None:
        if generator is None:
            generator = torch.Generator()
            generator.set_state(recipe.generator_state)
        kwargs = dict(kwargs, generator=generator)
    out = recipe.func(*args, **kwargs)
    if recipe.index is not None:
        out = out[recipe.index]
    memo[id(recipe)] = out
    return out


class Recorded:
    """The output of ``record``: a pytree whose large leaves are recipes (meta tensors)."""

    def __init__(self, out: Any, recorder: _Recorder):
        self.out, self._recorder = out, recorder

    def materialise(self, leaf: Any) -> Any:
        """The real value of one leaf of ``out`` (computed now, nothing else kept)."""
        recipe = self._recorder.recipe_of(leaf)
        return leaf if recipe is None else _replay(recipe, {})


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Recorded:
    """Run ``fn`` lazily (module doc): large tensors are recorded, not computed."""
    recorder = _Recorder()
    with recorder:
        out = fn(*args, **kwargs)
    return Recorded(out, recorder)
