"""``LoraModel``: the adapters of a frozen base as a model of their own, which a ``cfx.parallel.Plan``
trains through the parts protocol like any chain of blocks.

    lm = LoraModel(model, config, base)        # base: model's params (fp32, bf16, or int8 via cfx.quant)
    adapters = lm.init(key)                    # cfx.lora.init(model, config, key): the params of lm
    loss = lm.loss(adapters, tokens, targets)  # == model.loss(cfx.lora.attach(base, adapters, config), ...)

Its params are the adapters alone (``axes``: ``cfx.lora.axes``, so a plan's rules split ``A`` like the
base's input dim and ``B`` like its output), so gradients, optimizer state and checkpoints hold them
alone. Block ``i`` is a ``LoraBlock`` holding block ``i`` of the frozen base: it attaches its adapters
to it and runs the base block, so what wraps a block -- ZeRO-3's gathering, remat, a pipeline stage --
wraps the adapters' block and gathers, recomputes or stages the adapters while the base stays as given
(each process keeps the whole base; a pipeline rank runs the blocks of its stages, each with its own
frozen block). The embedding and the head run on the base's top-level params.

Under a model axis (``tensor_parallel(axis)``, the hook a Plan calls) the base model is split by
``split(model, axis) -> (split model, the base params' specs)`` and every rank runs on its block of the
frozen base under those specs, next to its block of the adapters under the plan's: a column-parallel
Linear's ``B`` splits with its output, a row-parallel one's ``A`` with its input, and the row-parallel sum
over ranks completes ``x A`` with ``x W``; the factors whole on every rank (that ``A``, that ``B``)
get their gradients summed over the ranks (``vary_adapters``). ``split`` comes from above this layer
(Megatron's lives in ``cfx.parallel``): ``cfx._src.train.model.lora_model`` passes it.

Adapters sit in the blocks only (targets such as ``blocks.*.attn.q.w``; the presets pick those), and
without dropout: a model hands its blocks dropout keys only for its own dropout, so the adapters'
would be silently off (train them with dropout through ``cfx.lora.attach(..., key=)`` in a loss
function instead).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lora.adapters import attach, axes as adapter_axes, init as adapter_init
from cfx._src.lora.config import LoraConfig, resolve
from cfx._src.mesh.context import current
from cfx._src.mesh.layout import block_of
from cfx._src.mesh.spec import P, is_spec
from cfx._src.models.common import check_params
from cfx._src.nn.lora_weight import LoraWeight, is_weight_node
from cfx._src.precision.quant import QuantizedWeight
from cfx._src.transforms.shapes import eval_shape

WHERE = "cfx.lora model"


def rank_block(tree: Any, specs: Any) -> Any:
    """This rank's block of the global ``tree`` (inside ``shard_map``) under ``specs`` (a pytree of
    ``P`` shaped like it, weights as single leaves): views, no copies. An int8 weight's ``q`` splits
    as its spec says, its per-column ``scale`` with the output dim."""
    if specs is None:
        return tree
    ctx = current(WHERE)
    leaves, treedef = tree_util.flatten(tree, is_leaf=is_weight_node)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))

    def local(x: Any, spec: P) -> Any:
        if isinstance(x, QuantizedWeight):
            out = P(*tuple(spec)[1:2])  # (out,) scales split with the weight's columns
            return QuantizedWeight(block_of(x.q, spec, ctx.mesh, ctx.coords),
                                   block_of(x.scale, out, ctx.mesh, ctx.coords))
        return block_of(x, spec, ctx.mesh, ctx.coords) if isinstance(x, torch.Tensor) else x
    return tree_util.unflatten(treedef, [local(x, s) for x, s in zip(leaves, spec_leaves)])


def _axes(spec: P, dim: int) -> tuple[str, ...]:
    return tuple(spec.axes_of(dim)) if dim < len(spec) else ()


def vary_adapters(tree: Any, specs: Any) -> Any:
    """``tree`` (params with ``LoraWeight`` s, each rank's blocks) with each adapter factor that is
    whole on every rank of an axis its base weight is split over marked as meeting that split:
    ``A`` ``pvary``'d over the axes of the weight's output dim, ``B`` over those of its input dim.
    Their gradients are then summed over those ranks (``pvary``'s transpose), as the Megatron
    split's own ``f`` sums the input's: a column-parallel Linear's whole ``A`` gets a share of
    ``x A``'s gradient from each rank's columns of ``B``, a row-parallel one's whole ``B`` a share
    of its gradient from each rank's rows of ``A``. One ``pvary`` per shared ``A``."""
    leaves, treedef = tree_util.flatten(tree, is_leaf=is_weight_node)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    done: dict[tuple[int, tuple], torch.Tensor] = {}

    def vary(x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        if not axes:
            return x
        if (id(x), axes) not in done:
            done[id(x), axes] = lax.pvary(x, axes)
        return done[id(x), axes]

    out = [dataclasses.replace(x, A=vary(x.A, _axes(s, 1)), B=vary(x.B, _axes(s, 0))) if isinstance(x, LoraWeight)
           else x for x, s in zip(leaves, spec_leaves)]
    return tree_util.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraBlock:
    """Block ``block`` over its frozen params ``base``: ``apply(adapters, x, ...)`` runs ``block`` on
    ``attach(base, adapters)`` (this rank's block of ``base`` under ``specs``, if given). ``template``
    is its adapters' shapes and ``names`` their logical axes."""

    block: Any
    base: Any
    lora: LoraConfig
    template: Any
    names: Any
    specs: Any = None

    def init(self, key: torch.Tensor) -> Any:
        """Zeros shaped like its adapters (what per-block code counts, e.g. a pipeline's partition;
        ``LoraModel.init`` draws the adapters of every block)."""
        del key
        return tree_util.map(lambda x: torch.zeros(x.shape, dtype=x.dtype), self.template)

    def axes(self) -> Any:
        return self.names

    def check(self, n: int) -> None:
        """The base block's check of a model axis of ``n`` ranks (tensor parallelism)."""
        self.block.check(n)

    def apply(self, adapters: Any, x: torch.Tensor, **kwargs: Any) -> Any:
        return self.block.apply(self._params(adapters), x, **kwargs)

    def apply_with_stats(self, adapters: Any, x: torch.Tensor, **kwargs: Any) -> Any:
        """The base block's ``apply_with_stats`` (a mixture of experts': its output and router statistics)."""
        return self.block.apply_with_stats(self._params(adapters), x, **kwargs)

    def _params(self, adapters: Any) -> Any:
        """The block's params as it runs: this rank's block of the base with ``adapters`` attached."""
        base = rank_block(self.base, self.specs)
        if not tree_util.leaves(adapters):  # a block the targets pick nothing in runs as it is
            return base
        base = attach(base, adapters, self.lora)
        if self.specs is not None:  # a split block: the whole factors meet each rank's share
            base = vary_adapters(base, self.specs)
        return base


@dataclasses.dataclass(frozen=True, eq=False)
class LoraModel:
    """The adapters ``lora`` puts on ``model`` over its frozen params ``base``, as a model (module doc).
    ``specs``: the base's specs when ``model`` is split over a mesh axis; ``split``: how a model axis
    splits ``model``; ``blocks``: the ``LoraBlock`` s (made from ``model``'s, or wrapped ones)."""

    model: Any
    lora: LoraConfig
    base: Any
    specs: Any = None
    split: Callable[[Any, str], tuple[Any, Any]] | None = None
    blocks: tuple = None

    def __post_init__(self):
        if self.blocks is None:
            object.__setattr__(self, "blocks", self._lora_blocks())
        it = iter(self.blocks)
        object.__setattr__(self, "_inner", self.model.map_blocks(lambda b: next(it)))  # the blocks, bound

    def _lora_blocks(self) -> tuple:
        """A ``LoraBlock`` per block of ``model``, after checking ``base`` and where the adapters sit."""
        if not isinstance(self.lora, LoraConfig):
            raise ValueError(f"{WHERE}: expected a cfx.lora.LoraConfig, got {type(self.lora).__name__}.")
        if self.lora.dropout:
            raise ValueError(f"{WHERE}: adapter dropout is not wired through a model's blocks (they get dropout keys "
                             "for the model's own dropout only); use LoraConfig(dropout=0), or train with dropout "
                             "through cfx.lora.attach(params, adapters, config, key=key) in a loss function.")
        model = self.model
        if not isinstance(getattr(model, "blocks", None), tuple) or not callable(getattr(model, "map_blocks", None)):
            raise ValueError(f"{WHERE}: {type(self.model).__name__} has no chain of blocks (blocks, map_blocks); "
                             "train its adapters as a loss function instead: plan.step(lambda ad, *b: "
                             "model.loss(cfx.lora.attach(base, ad, config), *b), tx, params=adapters).")
        check_params(f"{WHERE}: the frozen base", self.model, self.base)
        outside = [u.path for u in resolve(self.model, self.lora, WHERE) if not u.parent.startswith("blocks.")]
        if outside:
            raise ValueError(f"{WHERE}: the targets {self.lora.targets!r} pick {outside[0]!r}, outside the blocks; "
                             "a LoraModel adapts Linears inside blocks (e.g. the attn, mlp or all-linear presets, or "
                             "'blocks.*.attn.q.w'). Narrow the targets, or train those adapters as a loss function.")
        n = len(self.model.blocks)
        shapes = eval_shape(lambda k: adapter_init(model, self.lora, k), random.key(0)).get("blocks", [{}] * n)
        names = adapter_axes(self.model, self.lora).get("blocks", [{}] * n)
        specs = self.specs["blocks"] if self.specs is not None else [None] * n
        return tuple(LoraBlock(b, p, self.lora, t, a, s)
                     for b, p, t, a, s in zip(self.model.blocks, self.base["blocks"], shapes, names, specs))

    # -- the model protocol --------------------------------------------------------------------------
    @property
    def config(self) -> Any:  # the base model's (vocabulary, context, dropout): what generic code reads
        return self.model.config

    @property
    def max_len_name(self) -> str:
        return self.model.max_len_name

    @property
    def vocab_axis(self) -> str | None:
        return getattr(self.model, "vocab_axis", None)

    def init(self, key: torch.Tensor) -> Any:
        """The adapters (``cfx.lora.init(model, lora, key)``): this model's params."""
        return adapter_init(self.model, self.lora, key)

    def axes(self) -> Any:
        return adapter_axes(self.model, self.lora)

    def map_blocks(self, f: Callable[[Any], Any]) -> "LoraModel":
        """The same adapters with every ``LoraBlock`` replaced by ``f(block)`` (remat, ZeRO-3's gathering)."""
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def _top(self) -> dict:
        """The base's params outside the blocks (embeddings, final norm, head), this rank's block of them."""
        top = {k: v for k, v in self.base.items() if k != "blocks"}
        return rank_block(top, None if self.specs is None else {k: v for k, v in self.specs.items() if k != "blocks"})

    def _params(self, adapters: Any) -> dict:
        return {**self._top(), "blocks": adapters["blocks"]}

    def apply(self, adapters: Any, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The base model's ``apply`` with the adapters attached (logits)."""
        return self._inner.apply(self._params(adapters), tokens, **kwargs)

    def loss(self, adapters: Any, tokens: torch.Tensor, targets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The base model's ``loss`` with the adapters attached."""
        return self._inner.loss(self._params(adapters), tokens, targets, **kwargs)

    def parts(self) -> Any:
        """The base model's parts over the frozen embedding and head: every top-level param is the
        base's, so the stages own none of this model's."""
        inner = self._inner.parts()
        return dataclasses.replace(inner, first=(), last=(),
                                   embed=lambda p, tokens: inner.embed(self._top(), tokens),
                                   head_loss=lambda p, x, targets: inner.head_loss(self._top(), x, targets))

    def tensor_parallel(self, axis: str) -> "LoraModel":
        """The same adapters over ``split(model, axis)``: each rank runs on its block of the base (module doc)."""
        if self.split is None:
            raise ValueError(f"{WHERE}: no split over a model axis was given (split=); build it with "
                             "cfx._src.train.model.lora_model, which passes Megatron's.")
        if self.specs is not None or any(not isinstance(b, LoraBlock) for b in self.blocks):
            raise ValueError(f"{WHERE}: split the model over {axis!r} once, before wrapping its blocks.")
        model, specs = self.split(self.model, axis)
        return LoraModel(model, self.lora, self.base, specs=specs)
