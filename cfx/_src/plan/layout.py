"""How a Plan stores a model's params between steps, and the views each rank computes on.

Specs come from the model's logical axes (``model.axes()``) through rules: Megatron's
``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` -> ``model`` when the mesh has a model axis, all
else replicated. Without a pipe axis the stored tree *is* the model's params tree.

With a pipe axis of ``p`` ranks and ``v`` virtual stages per rank, each stage runs ``k`` of the
``L`` blocks (``L = p * v * k``) and a rank must hold only its own stages' blocks. The stored
tree then replaces the list ``params["blocks"]`` by one *stacked* block tree: each leaf of global
shape ``(L, *leaf)`` with spec ``P("pipe", *leaf_spec)``, rows in rank-major order (rank 0's
stages, chunk 0 first, then rank 1's, ...), so rank ``r``'s block along ``pipe`` is exactly the
``v * k`` blocks it runs. Embeddings and the head stay replicated over ``pipe`` (the pipeline
keeps a tied embedding's two uses in sync). ``to_model`` / ``to_stored`` convert global trees;
``local_view`` / ``stack_local`` convert a rank's blocks (views, no copies, one way).

With ``zero=3`` (no pipe axis) the stored params are ZeRO-3's ``ZeroParams``: each leaf's
padded flat piece per rank, spec ``P((*leaf_axes, "data"))`` (``cfx.zero.param_specs``); the
optimizer then sees the model's tree (``opt_shapes`` / ``opt_specs``). ``init``, ``gather`` and
``put`` hide which form is stored.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src import random
from cfx._src import tree as tree_util
from cfx._src.arrays import device_get, device_put
from cfx._src.init_sharded import init_sharded
from cfx._src.lax import collectives as lax
from cfx._src.mesh.spec import P, is_spec
from cfx._src.parallel.megatron import MEGATRON_RULES
from cfx._src.parallel.rules import Rules
from cfx._src.shapes import eval_shape
from cfx._src.shard_map import shard_map
from cfx._src.zero.params import gather_params, shard_params
from cfx._src.zero.params import init_params as zero_init_params
from cfx._src.zero.params import param_specs as zero_param_specs


class Layout:
    """The stored layout of ``model``'s params for a plan on ``mesh`` (module doc)."""

    def __init__(self, cfg, model, mesh):
        self.cfg, self.mesh = cfg, mesh
        tp = cfg.has("model")
        self.rules = Rules({"batch": "data" if cfg.has("data") else None,
                            **({k: "model" for k in MEGATRON_RULES} if tp else {})})
        axes = model.axes()
        self.model_shapes = eval_shape(model.init, random.key(0))
        self.model_specs = self.rules.specs(axes, mesh=mesh)
        self.stacked = cfg.has("pipe")
        self.order: tuple[int, ...] = ()
        if self.stacked:
            self.order = stored_order(len(model.blocks), cfg.size("pipe"), cfg.chunks, type(model).__name__)
            _check_uniform(self.model_shapes["blocks"], type(model).__name__)
            block_specs = self.model_specs["blocks"][0]
            self.specs = {**self.model_specs, "blocks": tree_util.map(lambda s: P("pipe", *s), block_specs,
                                                                       is_leaf=is_spec)}
        else:
            self.specs = self.model_specs
        self.shapes = self.to_stored(self.model_shapes)
        self.batch_spec = self.rules.spec(("batch", None))
        self.zero3 = cfg.zero == 3
        self.opt_shapes, self.opt_specs = self.shapes, self.specs  # what ZeRO's optimizer is laid out over
        if self.zero3:
            self.specs = zero_param_specs(self.model_specs, self.model_shapes, axis="data", mesh=mesh)
            self.opt_shapes, self.opt_specs = self.model_shapes, self.model_specs

    # -- building and reading the stored params ---------------------------------------------------
    def init(self, init, key) -> Any:
        """``init(key)`` built straight into the stored layout; each process allocates its blocks."""
        if self.zero3:
            return zero_init_params(init, key, mesh=self.mesh, axis="data", param_specs=self.model_specs)
        return init_sharded(lambda k: self.to_stored(init(k)), key, mesh=self.mesh, specs=self.specs)

    def gather(self, stored: Any) -> Any:
        """The model's params as global tensors (a collective: every process calls it)."""
        if self.zero3:
            stored = shard_map(lambda z: gather_params(z, axis="data"), mesh=self.mesh, in_specs=(self.specs,),
                               out_specs=self.model_specs)(stored)
        return self.to_model(device_get(stored))

    def put(self, params: Any) -> Any:
        """Global model params (a checkpoint) in the stored layout."""
        if self.zero3:
            arrays = put_tree(params, self.model_specs, self.mesh)
            return shard_map(lambda p: shard_params(p, axis="data"), mesh=self.mesh, in_specs=(self.model_specs,),
                             out_specs=self.specs)(arrays)
        return put_tree(self.to_stored(params), self.specs, self.mesh)

    @property
    def rows_per_rank(self) -> int:
        return len(self.order) // self.cfg.size("pipe") if self.stacked else 0

    # -- global trees ----------------------------------------------------------------------------
    def to_stored(self, params: Any) -> Any:
        """The model's params tree (tensors or ShapeDtypes) in the stored layout."""
        if not self.stacked:
            return params
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
        """A rank's stored blocks as the model's tree with ``blocks`` = its own blocks (row views)."""
        if not self.stacked:
            return stored_local
        n = self.rows_per_rank
        return {**stored_local, "blocks": [tree_util.map(lambda x, j=j: x[j], stored_local["blocks"])
                                           for j in range(n)]}

    def gather_blocks(self, stored_local: Any) -> Any:
        """Inside shard_map: the model's whole params tree on this rank, the other stages' blocks
        all-gathered over ``pipe``, ZeRO-3's pieces over ``data`` (for inference; the step never
        does this)."""
        if self.zero3:
            return gather_params(stored_local, axis="data")
        if not self.stacked:
            return stored_local
        rows = tree_util.map(lambda x: lax.all_gather(x, "pipe", dim=0, tiled=True), stored_local["blocks"])
        return self.to_model({**stored_local, "blocks": rows})

    def stack_local(self, tree: Any) -> Any:
        """The inverse of ``local_view`` for a tree shaped like it (grads, updates): stacked rows."""
        if not self.stacked:
            return tree
        return {**tree, "blocks": tree_util.map(lambda *xs: torch.stack(xs), *tree["blocks"])}


def put_tree(tree: Any, specs: Any, mesh) -> Any:
    """``device_put`` of every leaf of a global tree with its spec."""
    leaves, treedef = tree_util.flatten(tree)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    if len(leaves) != len(spec_leaves):
        raise ValueError(f"Plan: {len(leaves)} leaves for {len(spec_leaves)} specs on {mesh!r}; the state must "
                         "come from a run of the same plan on the same model.")
    return tree_util.unflatten(treedef, [device_put(x, mesh, s) for x, s in zip(leaves, spec_leaves)])


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
