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
(each process keeps the whole base). The embedding and the head run on the base's top-level params.
The model is a function of (adapters, base) and knows nothing of where the base is: a Plan keeps it
as it keeps its state instead (``models.frozen``'s hooks ``frozen`` / ``place_frozen``; the Plan's
``plan/frozen.py``, which ``Plan.step`` applies and which is the program's ``TrainState.frozen``):
under ZeRO-3 each rank keeps ``1/n`` of it, every block's gathered just before it runs and freed
after, without gradients; under a pipe axis only the ranks of the stage that runs a block keep its
base (the embedding's on the first stage, the head's on the last), and ``apply`` / ``loss`` (the
whole model on every rank, e.g. ``Program.sample``) share each stage's over ``pipe`` as they run;
with offload in host memory or in files.

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

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lora.adapters import attach, axes as adapter_axes, init as adapter_init
from cfx._src.lora.config import LoraConfig, resolve
from cfx._src.mesh.context import current
from cfx._src.mesh.spec import P, is_spec
from cfx._src.models.common import check_params
from cfx._src.models.frozen import block_at, is_placed, whole
from cfx._src.nn.lora_weight import LoraWeight, is_weight_node
from cfx._src.transforms.shapes import eval_shape

WHERE = "cfx.lora model"


def rank_block(tree: Any, specs: Any) -> Any:
    """This rank's block of the global ``tree`` (inside ``shard_map``) under ``specs`` (a pytree of
    ``P`` shaped like it, weights as single leaves): views, no copies. An int8 weight's ``q`` splits
    as its spec says, its per-column ``scale`` with the output dim."""
    if specs is None:
        return tree
    ctx = current(WHERE)
    return block_at(tree, specs, ctx.mesh, ctx.coords)


def _frozen(base: Any, specs: Any, device: torch.device) -> Any:
    """A context giving this rank's block of the frozen ``base``: gathered for its body if a plan
    placed it (``place_frozen``), else its block under ``specs`` (views)."""
    if is_placed(base):
        return base.gathered(device)
    return contextlib.nullcontext(rank_block(base, specs))


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
        with _frozen(self.base, self.specs, x.device) as base:
            return self.block.apply(self._params(base, adapters), x, **kwargs)

    def apply_with_stats(self, adapters: Any, x: torch.Tensor, **kwargs: Any) -> Any:
        """The base block's ``apply_with_stats`` (a mixture of experts': its output and router statistics)."""
        with _frozen(self.base, self.specs, x.device) as base:
            return self.block.apply_with_stats(self._params(base, adapters), x, **kwargs)

    def _params(self, base: Any, adapters: Any) -> Any:
        """The block's params as it runs: this rank's block of the base with ``adapters`` attached."""
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
    presplit: tuple | None = None  # placed on a mesh with a model axis: (split model, its specs)

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
    def logits_axis(self) -> str | None:
        return getattr(self.model, "logits_axis", None)

    def init(self, key: torch.Tensor) -> Any:
        """The adapters (``cfx.lora.init(model, lora, key)``): this model's params."""
        return adapter_init(self.model, self.lora, key)

    def axes(self) -> Any:
        return adapter_axes(self.model, self.lora)

    def map_blocks(self, f: Callable[[Any], Any]) -> "LoraModel":
        """The same adapters with every ``LoraBlock`` replaced by ``f(block)`` (remat, ZeRO-3's gathering)."""
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def _top(self, device: torch.device, part: str = "all") -> Any:
        """A context giving the base's params outside the blocks (embeddings, final norm, head), this
        rank's block of them (gathered for its body when the base is sharded); ``part``: ``first`` (what
        the embedding reads) or ``last`` (the head's) suffice where the base is staged over ``pipe``."""
        if self.presplit is not None:
            raise ValueError(f"{WHERE}: the base was placed for a mesh with a model axis (place_frozen); run it "
                             "under that Plan, which splits it, or place it on a mesh without a model axis.")
        if isinstance(self.base, StagedTop):
            return self.base.gathered(device, part)
        if is_placed(self.base):
            return self.base.gathered(device)
        top = {k: v for k, v in self.base.items() if k != "blocks"}
        return contextlib.nullcontext(
            rank_block(top, None if self.specs is None else {k: v for k, v in self.specs.items() if k != "blocks"}))

    def apply(self, adapters: Any, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The base model's ``apply`` with the adapters attached (logits)."""
        with whole(), self._top(tokens.device) as top:
            return self._inner.apply({**top, "blocks": adapters["blocks"]}, tokens, **kwargs)

    def loss(self, adapters: Any, tokens: torch.Tensor, targets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The base model's ``loss`` with the adapters attached."""
        with whole(), self._top(tokens.device) as top:
            return self._inner.loss({**top, "blocks": adapters["blocks"]}, tokens, targets, **kwargs)

    def parts(self) -> Any:
        """The base model's parts over the frozen embedding and head: every top-level param is the
        base's, so the stages own none of this model's (a sharded top is gathered around each)."""
        inner = self._inner.parts()

        def embed(p, tokens):
            with self._top(tokens.device, "first") as top:
                return inner.embed(top, tokens)

        def head_loss(p, x, targets):
            with self._top(x.device, "last") as top:
                return inner.head_loss(top, x, targets)
        return dataclasses.replace(inner, first=(), last=(), embed=embed, head_loss=head_loss)

    @property
    def frozen(self) -> Any:
        """The frozen base as held now (``models.frozen``): ``{"top": ..., "blocks": [...]}``, each a tree
        or, once a plan placed it (``place_frozen``), a placed tree; what a program's ``TrainState.frozen`` is."""
        if not self.base_placed:
            return self.base
        return {"top": self.base, "blocks": [_inner_base(b) for b in self.blocks]}

    def place_frozen(self, placer: Any) -> "LoraModel":
        """The same adapters over the frozen base as ``placer`` keeps it (``models.frozen``; a Plan's:
        ``plan.frozen.Placer``): each block's base placed on its own, gathered just before the block
        runs and freed after, without gradients; the embedding and head likewise around their use.
        Under a pipe axis (``placer.stages``) only the stage that runs a block holds its base (the
        embedding's with block 0's stage, the head's with the last block's). On a mesh with a model
        axis the base is split over it first (``split``), as the Plan will split the model."""
        if self.base_placed or any(not isinstance(b, LoraBlock) for b in self.blocks):
            raise ValueError(f"{WHERE}: place the frozen base once, before the Plan wraps the blocks.")
        n = len(self.blocks)
        stage_of = placer.stage_of(n)
        model, specs, presplit = self.model, self.specs, None
        if specs is None and placer.mesh.shape.get("model", 1) > 1:
            if self.split is None:
                raise ValueError(f"{WHERE}: the mesh has a model axis but no split was given (split=); build it with "
                                 "cfx._src.train.model.lora_model, which passes Megatron's.")
            model, specs = presplit = self.split(self.model, "model")
        block_specs = specs["blocks"] if specs is not None else [None] * n
        blocks = tuple(dataclasses.replace(b, base=placer.place(b.base, s, c))
                       for b, s, c in zip(self.blocks, block_specs, stage_of))
        top_specs = None if specs is None else {k: v for k, v in specs.items() if k != "blocks"}
        if placer.stages is None:
            top = {k: v for k, v in self.base.items() if k != "blocks"}
            return dataclasses.replace(self, base=placer.place(top, top_specs), blocks=blocks, presplit=presplit)
        parts = self.model.parts()

        def held(keys: tuple[str, ...], stage: int) -> Any:  # the top-level params one part reads
            sub = lambda t: None if t is None else {k: t[k] for k in keys}  # noqa: E731
            return placer.place(sub(self.base), sub(top_specs), stage)
        top = StagedTop(held(parts.first, stage_of[0]), held(parts.last, stage_of[n - 1]))
        return dataclasses.replace(self, base=top, blocks=blocks, presplit=presplit)

    @property
    def base_placed(self) -> bool:
        """Whether ``place_frozen`` placed the frozen base already (it places it once)."""
        return isinstance(self.base, StagedTop) or is_placed(self.base)

    def base_bytes(self, rank: int, *, blocks_only: bool = False) -> int:
        """Bytes of the frozen base rank ``rank`` keeps (``blocks_only``: of its blocks' bases): its shards
        once a plan placed it, else the whole base."""
        if isinstance(self.base, dict):
            tree = self.base["blocks"] if blocks_only else self.base
            return sum(x.numel() * x.element_size() for x in tree_util.leaves(tree))
        top = 0 if blocks_only else sum(b.nbytes(rank) for b in (
            self.base if isinstance(self.base, StagedTop) else (self.base,)))
        return top + sum(_inner_base(b).nbytes(rank) for b in self.blocks)

    def tensor_parallel(self, axis: str) -> "LoraModel":
        """The same adapters over ``split(model, axis)``: each rank runs on its block of the base (module doc)."""
        if self.split is None:
            raise ValueError(f"{WHERE}: no split over a model axis was given (split=); build it with "
                             "cfx._src.train.model.lora_model, which passes Megatron's.")
        if self.specs is not None or any(not isinstance(b, LoraBlock) for b in self.blocks):
            raise ValueError(f"{WHERE}: split the model over {axis!r} once, before wrapping its blocks.")
        if self.base_placed:  # placed for this split already (place_frozen on the plan's mesh)
            if self.presplit is None or axis != "model":
                raise ValueError(f"{WHERE}: the base was placed on a mesh without a model axis; place it "
                                 f"with the Plan's mesh (model axis {axis!r}).")
            model, specs = self.presplit
            blocks = tuple(dataclasses.replace(b, block=sb, specs=s)
                           for b, sb, s in zip(self.blocks, model.blocks, specs["blocks"]))
            return dataclasses.replace(self, model=model, specs=specs, blocks=blocks, presplit=None)
        model, specs = self.split(self.model, axis)
        return LoraModel(model, self.lora, self.base, specs=specs)


class StagedTop(NamedTuple):
    """The base's params outside the blocks staged over ``pipe`` (``place_frozen`` with stages): those the
    embedding reads on block 0's stage, those the head reads on the last block's (a tied embedding on both)."""

    first: Any  # placed trees (models.frozen)
    last: Any

    @contextlib.contextmanager
    def gathered(self, device: torch.device, part: str):
        """``part`` (``first``, ``last``, or ``all``: both, shared over ``pipe`` inside ``whole()``) gathered."""
        with contextlib.ExitStack() as stack:
            got = [stack.enter_context(b.gathered(device)) for name, b in zip(self._fields, self)
                   if part in (name, "all")]
            yield {k: v for tree in got for k, v in tree.items()}


def _inner_base(block: Any) -> Any:
    """The placed base of a ``LoraBlock`` (or of one a Plan wrapped: remat, ZeRO-3's gathering)."""
    while not isinstance(block, LoraBlock):
        block = getattr(block, "layer", None) or getattr(block, "block")
    return block.base
