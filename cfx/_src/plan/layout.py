"""How a Plan stores a model's params between steps, and the views each rank computes on.

Specs come from the model's logical axes (``model.axes()``) through the rules the plan's strategies
give (``Strategy.rules``: Megatron's ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` -> ``model``, a
mixture of experts' ``experts`` -> ``expert``), all else replicated, or from a strategy's own specs
(``Strategy.param_specs``: the tensor grid's); batches split their rows over ``data`` (and ``expert``)
and, with sequence parallelism, their positions over ``seq`` (``model`` for Megatron-SP). Without
a pipe axis the stored tree *is* the model's params tree.

With a pipe axis of ``p`` ranks and ``v`` virtual stages per rank, each stage runs ``k`` of the
``L`` blocks (``L = p * v * k``) and a rank must hold only its own stages' blocks. The stored
tree then replaces the list ``params["blocks"]`` by one *stacked* block tree: each leaf of global
shape ``(L, *leaf)`` with spec ``P("pipe", *leaf_spec)``, rows in rank-major order (rank 0's
stages, chunk 0 first, then rank 1's, ...), so rank ``r``'s block along ``pipe`` is exactly the
``v * k`` blocks it runs. Embeddings and the head stay replicated over ``pipe`` (the pipeline
keeps a tied embedding's two uses in sync). ``to_model`` / ``to_stored`` convert global trees;
``local_view`` / ``stack_local`` convert a rank's blocks (views, no copies, one way).

With ``zero=3`` the stored params are ZeRO-3's pieces: each leaf's padded flat piece per data
rank, spec ``P((*leaf_axes, "data"))`` (``cfx.zero.param_specs``), a stage's blocks stacked the
same way (``P("pipe", (*leaf_axes, "data"))``); ``local_view`` gives the rank's ``ZeroParams``.
``init``, ``gather`` and ``put`` hide which form is stored. Where the stored layout differs from
the model's tree (stacked stages, ZeRO-3) the optimizer steps the rank's ``local_view``
(``opt_on_local``), so per-leaf rules see blocks, not stacks.
"""
from __future__ import annotations

import functools

import math
from typing import Any

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.spmd.arrays import device_get
from cfx._src.spmd.init_sharded import init_sharded
from cfx._src.lax import collectives as lax
from cfx._src.mesh.layout import block_shape, check_spec
from cfx._src.mesh.spec import P, is_spec
from cfx._src.parallel.rules import Rules
from cfx._src.transforms.shapes import ShapeDtype, eval_shape
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.spec_tree import broadcast_specs
from cfx._src.zero.flat import piece_size
from cfx._src.zero.params import ZeroParams, gather_params, global_pieces, shard_params
from cfx._src.zero.params import param_specs as zero_param_specs
from cfx._src.models.parts import hook


def param_shapes(model) -> Any:
    """``eval_shape(model.init, key)``, remembered for the last few models (a plan search lays out one
    model many times; a model is a frozen dataclass, equal models have equal shapes). A fresh tree
    of the same ``ShapeDtype`` leaves each call; an unhashable model is traced every time."""
    try:
        shapes = _param_shapes(model)
    except TypeError:
        return eval_shape(model.init, random.key(0))
    return tree_util.map(lambda x: x, shapes)


@functools.lru_cache(maxsize=4)
def _param_shapes(model) -> Any:
    return eval_shape(model.init, random.key(0))


class Layout:
    """The stored layout of ``model``'s params for a plan on ``mesh`` (module doc)."""

    def __init__(self, cfg, model, mesh, strategies: tuple = ()):
        self.cfg, self.mesh = cfg, mesh
        rules = {k: v for s in strategies for k, v in s.rules(cfg).items()}  # the params' logical axes
        self.rules = Rules({"batch": cfg.batch_axes or None, "length": cfg.sequence_axis, **rules})
        self.model_shapes = param_shapes(model)
        own = [x for x in (s.param_specs(cfg, model, mesh) for s in strategies) if x is not None]
        self.model_specs = own[0] if own else self._model_specs(model, mesh)
        # tokens (B, T): the sequence split too; a model may name its batch's axes (a Denoiser's: rows)
        self.batch_spec = self.rules.spec(hook(model, "batch_axes", ("batch", "length")))
        self.stacked, self.zero3 = cfg.has("pipe"), cfg.zero == 3
        self.order: tuple[int, ...] = ()
        if self.stacked:
            self.order = stored_order(len(model.blocks), cfg.size("pipe"), cfg.chunks, type(model).__name__)
            _check_uniform(self.model_shapes["blocks"], type(model).__name__)
        # the params as whole (tensor-parallel) leaves: what zero<3 stores
        self.plain_specs = self.to_stored(self.model_specs, spec=True)
        self.shapes = self.to_stored(self.model_shapes)
        self.specs = self.plain_specs
        if self.zero3:  # each leaf's padded flat piece per data rank (cfx.zero.param_specs)
            zp = zero_param_specs(self.model_specs, self.model_shapes, axis="data", mesh=mesh)
            self.n = zp.n
            self.specs = self.to_stored(zp.pieces, spec=True)
            # one rank's ZeroParams: the model's tree with its own blocks, per-rank leaf shapes
            local_shapes = tree_util.unflatten(tree_util.structure(self.model_shapes), list(zp.shapes))
            self.local_shapes = self._local_tree(local_shapes)

    def _model_specs(self, model, mesh) -> Any:
        """The params' specs: the model's own (``param_specs``: a P or a pytree prefix, broadcast and
        checked against every leaf's shape), else its logical axes through the plan's rules (a strategy
        that lays params out otherwise -- the tensor grid's ``grid_specs`` -- gives its own)."""
        own = hook(model, "param_specs")
        if own is None:
            return self.rules.specs(model.axes(), mesh=mesh)
        where = f"Plan {str(self.cfg)!r}"
        items = broadcast_specs(own, self.model_shapes, "specs", mesh, where=where)
        for path, leaf, spec in items:
            check_spec(path, tuple(leaf.shape), spec, mesh, where)
        return tree_util.unflatten(tree_util.structure(self.model_shapes), [s for _, _, s in items])

    @property
    def rows_per_rank(self) -> int:
        return len(self.order) // self.cfg.size("pipe") if self.stacked else 0

    # -- building and reading the stored params ---------------------------------------------------
    def init(self, init, key) -> Any:
        """``init(key)`` built straight into the stored layout; each process allocates its blocks."""
        if self.zero3:
            tp_specs = tree_util.leaves(self.model_specs, is_leaf=is_spec)

            def pieces(k):
                leaves, treedef = tree_util.flatten(init(k))
                return self.to_stored(tree_util.unflatten(treedef, [
                    global_pieces(x, s, self.mesh, self.n) for x, s in zip(leaves, tp_specs)]))
            return init_sharded(pieces, key, mesh=self.mesh, specs=self.specs)
        return init_sharded(lambda k: self.to_stored(init(k)), key, mesh=self.mesh, specs=self.specs)

    def gather(self, stored: Any) -> Any:
        """The model's params as global tensors (a collective: every process calls it)."""
        if self.zero3:
            stored = shard_map(lambda z: self.stack_local(gather_params(self.local_view(z), axis="data")),
                               mesh=self.mesh, in_specs=(self.specs,), out_specs=self.plain_specs)(stored)
        return self.to_model(device_get(stored))

    def put(self, params: Any) -> Any:
        """Global model params (a checkpoint) in the stored layout."""
        self.check_params(params)
        arrays = put_tree(self.to_stored(params), self.plain_specs, self.mesh)
        if not self.zero3:
            return arrays

        def shard(plain):
            return self.stack_local(shard_params(self._rows(plain), axis="data").pieces)
        return shard_map(shard, mesh=self.mesh, in_specs=(self.plain_specs,), out_specs=self.specs)(arrays)

    def check_params(self, params: Any) -> None:
        """ValueError naming the first leaf whose shape or dtype is not what ``model.init`` makes
        (the plan's specs, ZeRO's flat state and its checkpoints are laid out for those)."""
        items, _ = tree_util.flatten_with_path(params)
        want = tree_util.leaves(self.model_shapes)
        if len(items) != len(want):
            return  # a structure mismatch: put_tree names the first differing path
        for (path, x), w in zip(items, want):
            if isinstance(x, torch.Tensor) and (tuple(x.shape) != tuple(w.shape) or x.dtype != w.dtype):
                raise ValueError(f"Plan {str(self.cfg)!r}: params leaf {path!r} is {x.dtype} {tuple(x.shape)}, but the "
                                 f"model initialises it as {w.dtype} {tuple(w.shape)}; a plan stores the params "
                                 "model.init makes: cast them (cfx.tree.map(lambda x: x.to(dtype), params)) and choose "
                                 "the compute dtype with precision=.")

    # -- global trees ----------------------------------------------------------------------------
    def to_stored(self, params: Any, *, spec: bool = False) -> Any:
        """The model's params tree (tensors, ShapeDtypes or, with ``spec``, specs) in the stored
        layout: blocks stacked in ``order`` under a pipe axis."""
        if not self.stacked:
            return params
        if spec:  # every block has block 0's specs, split over pipe on the new leading dim
            return {**params, "blocks": tree_util.map(lambda s: P("pipe", *s), params["blocks"][0],
                                                      is_leaf=is_spec)}
        blocks = [params["blocks"][i] for i in self.order]
        return {**params, "blocks": tree_util.map(lambda *xs: _stack(xs), *blocks)}

    def to_model(self, stored: Any) -> Any:
        """Global stored params (tensors) back in the model's tree: the inverse of ``to_stored``."""
        if not self.stacked:
            return stored
        rows = [tree_util.map(lambda x, j=j: x[j], stored["blocks"]) for j in range(len(self.order))]
        blocks = [None] * len(self.order)
        for j, i in enumerate(self.order):
            blocks[i] = rows[j]
        return {**stored, "blocks": blocks}

    # -- one rank's views ------------------------------------------------------------------------
    def local_view(self, stored_local: Any) -> Any:
        """A rank's stored params as the model's tree whose ``blocks`` are its own (row views);
        under ZeRO-3 the ``ZeroParams`` of that tree."""
        tree = self._rows(stored_local)
        if self.zero3:
            return ZeroParams(tree, tree_util.leaves(self.local_shapes, is_leaf=_is_shape), self.n)
        return tree

    @property
    def opt_on_local(self) -> bool:
        """Whether the optimizer runs on each rank's ``local_view`` (its blocks one by one: per-leaf
        rules like LAMB's trust ratio see blocks, not stacks) rather than on the stored layout."""
        return self.zero3 or self.stacked

    def local_abstract(self) -> Any:
        """One rank's ``local_view`` as ShapeDtypes (every rank's has these shapes)."""
        if not self.zero3:
            specs = tree_util.leaves(self.model_specs, is_leaf=is_spec)
            leaves, treedef = tree_util.flatten(self.model_shapes)
            return self._local_tree(tree_util.unflatten(treedef, [
                ShapeDtype(block_shape(x.shape, s, self.mesh), x.dtype) for x, s in zip(leaves, specs)]))
        dtypes = self._local_tree(tree_util.map(lambda x: x.dtype, self.model_shapes))
        shapes = tree_util.leaves(self.local_shapes, is_leaf=_is_shape)
        pieces = [ShapeDtype((piece_size(math.prod(s), self.n),), d) for s, d in zip(shapes, tree_util.leaves(dtypes))]
        return ZeroParams(tree_util.unflatten(tree_util.structure(dtypes), pieces), shapes, self.n)

    def norm_axes(self) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        """Per leaf of what the optimizer sees: the axes it is split over (not data), and those
        plus the axes over which other ranks hold other leaves (``cfx.optim.sharded``)."""
        if self.opt_on_local:
            local = self._local_tree(self.model_specs)
            split = [tuple(a for a in s.all_axes() if a != "data") for s in tree_util.leaves(local, is_leaf=is_spec)]
            if not self.stacked:
                return split, split
            marked = tree_util.leaves({**tree_util.map(lambda s: False, local, is_leaf=is_spec),  # flat positions
                                       "blocks": tree_util.map(lambda s: True, local["blocks"], is_leaf=is_spec)})
            blocks = {i for i, m in enumerate(marked) if m}  # of a stage's blocks: summed over pipe in totals
            return split, [a + ("pipe",) if i in blocks else a for i, a in enumerate(split)]
        split = [tuple(a for a in s.all_axes() if a != "data") for s in tree_util.leaves(self.specs, is_leaf=is_spec)]
        return split, split

    def stack_local(self, tree: Any) -> Any:
        """The inverse of ``local_view`` for a tree of tensors shaped like it (grads, updates, a
        ZeroParams or its pieces): the blocks' rows stacked."""
        if isinstance(tree, ZeroParams):
            tree = tree.pieces
        if not self.stacked:
            return tree
        return {**tree, "blocks": tree_util.map(lambda *xs: torch.stack(xs), *tree["blocks"])}

    def gather_blocks(self, stored_local: Any) -> Any:
        """Inside shard_map: the model's whole params tree on this rank, the other stages' blocks
        all-gathered over ``pipe``, ZeRO-3's pieces over ``data`` (for inference; the step never
        does this)."""
        plain = (self.stack_local(gather_params(self.local_view(stored_local), axis="data")) if self.zero3
                 else stored_local)  # the stored layout's whole (tensor-parallel) leaves
        if not self.stacked:
            return plain
        rows = tree_util.map(lambda x: lax.all_gather(x, "pipe", dim=0, tiled=True), plain["blocks"])
        return self.to_model({**plain, "blocks": rows})

    def _rows(self, stored_local: Any) -> Any:
        if not self.stacked:
            return stored_local
        return {**stored_local, "blocks": [tree_util.map(lambda x, j=j: x[j], stored_local["blocks"])
                                           for j in range(self.rows_per_rank)]}

    def _local_tree(self, tree: Any) -> Any:
        """A model-shaped tree of per-leaf metadata cut to one rank's blocks (all alike)."""
        if not self.stacked:
            return tree
        return {**tree, "blocks": [tree["blocks"][0]] * self.rows_per_rank}

    @property
    def local_specs(self) -> Any:
        """The tensor-parallel specs of one rank's ``local_view`` (what splits each of its leaves)."""
        return self._local_tree(self.model_specs)


def put_tree(tree: Any, specs: Any, mesh) -> Any:
    """A global tree laid out by ``specs`` (``device_put``'s one ``shard_map`` for the whole tree:
    a mismatch names the first differing leaf path)."""
    return shard_map(lambda t: t, mesh=mesh, in_specs=(specs,), out_specs=specs)(tree)


def stored_order(n_blocks: int, p: int, v: int, name: str) -> tuple[int, ...]:
    """Block index of each stored row: rank-major, each rank's stages chunk 0 first."""
    if n_blocks % (p * v):
        raise ValueError(f"Plan: {name} has {n_blocks} blocks, which do not split evenly into pipe={p} x "
                         f"chunks={v} stages; use a pipe size (x chunks) dividing {n_blocks}.")
    k = n_blocks // (p * v)
    return tuple((c * p + r) * k + t for r in range(p) for c in range(v) for t in range(k))


def _stack(xs: tuple) -> Any:
    x0 = xs[0]
    if isinstance(x0, torch.Tensor):
        return torch.stack(xs)
    return type(x0)((len(xs), *x0.shape), x0.dtype)  # ShapeDtype


def _check_uniform(blocks: list, name: str) -> None:
    ref = tree_util.map(lambda x: (tuple(x.shape), x.dtype), blocks[0])
    for i, b in enumerate(blocks[1:], 1):
        got = tree_util.map(lambda x: (tuple(x.shape), x.dtype), b)
        if tree_util.structure(got) != tree_util.structure(ref) or tree_util.leaves(got) != tree_util.leaves(ref):
            raise ValueError(f"Plan: {name}'s block {i} differs in params from block 0; a pipe axis stacks "
                             "each stage's blocks, so they must all have the same params shapes.")


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)
