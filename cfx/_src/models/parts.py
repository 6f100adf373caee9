"""The model protocol: what generic code (the pipeline, ``cfx.parallel.Plan``, tensor and sequence
parallelism, ``cfx.generate``, auto-parallel) may read of a model. It never names a model family.

Every model is a ``Model`` (``init`` / ``apply`` / ``axes``). A model the pipeline can cut speaks the
*parts protocol* (``ChainModel``): how it splits around a chain of blocks. It reads

    model.blocks            a tuple of layers with ``init`` / ``apply(p, x, mask=, key=)`` / ``axes``
    model.map_blocks(f)     the same model with every block replaced by ``f(block)``
    model.axes()            logical axis names, shaped like ``model.init``'s params
    model.parts()           -> ModelParts (below): what runs before and after the blocks

A model's params are a dict whose ``"blocks"`` entry is the list of block params; every other
top-level entry belongs to the embedding (``first``), the head (``last``) or both (a tied
embedding). ``embed`` maps inputs to the first block's input ``(B, T, C)``; ``head_loss`` maps the
last block's output to the scalar loss; ``block_loss``, where the blocks add terms of their own to
the loss (Mixtral's routers), runs a block and returns its term too. A family opts in by defining
``parts()``: GPT-2 and Llama do, and so must every new family that wants pipeline stages.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What runs around a model's blocks (see the module doc)."""

    first: tuple[str, ...]                                                  # top-level params of the embedding
    last: tuple[str, ...]                                                   # ... of the final norm, head and loss
    embed: Callable[[dict, torch.Tensor], torch.Tensor]                     # inputs (B, T) -> (B, T, C)
    head_loss: Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]   # (B, T, C), targets -> ()
    check: Callable[[torch.Tensor, torch.Tensor], None]                     # ValueError on bad inputs
    width: int                                                              # C: the blocks' activation width
    # the blocks' activation shape for a microbatch of inputs of this shape: (b, T) tokens -> (b, T, C)
    # by default; a model of feature rows says (b, D) -> (b, C)
    act_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None
    # an auxiliary loss the blocks add (a mixture of experts' routers'): (block, its params, x) -> (its
    # output, its scalar term of x's microbatch's loss); each stage adds its blocks' terms to every
    # microbatch's loss, the whole batch's term being the mean of the microbatches'. None: ``apply`` alone
    block_loss: Callable[[Any, Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # ValueError unless a microbatch of inputs of this shape can run (e.g. its tokens form whole groups)
    check_microbatch: Callable[[tuple[int, ...]], None] | None = None

    def activation_shape(self, inputs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.act_shape(tuple(inputs))) if self.act_shape is not None else (*inputs, self.width)

    @property
    def tied(self) -> tuple[str, ...]:
        """Top-level params used by both the embedding and the head."""
        return tuple(k for k in self.first if k in self.last)


class Model(Protocol):
    """A pure function over a params pytree, with its params' logical axes."""

    def init(self, key: torch.Tensor) -> Any: ...
    def apply(self, params: Any, *inputs: Any, **kwargs: Any) -> Any: ...
    def axes(self) -> Any: ...


class ChainModel(Model, Protocol):
    """A model around a chain of blocks: what the pipeline, remat per block and ZeRO-3 per block read."""

    blocks: tuple

    def map_blocks(self, f: Callable[[Any], Any]) -> "ChainModel": ...
    def parts(self) -> ModelParts: ...


class Hooks(Protocol):
    """What a model *may* define to take part in more of cfx; generic code reads these (and only
    these) through ``hook(model, name)`` / ``has_hook(model, name)``, so this class is the list."""

    config: Any                # a config with ``vocab_size`` and the field ``max_len_name`` names
    max_len_name: str          # the config field bounding the sequence length (``cfx.generate``'s check)
    real_vocab_size: int       # the ids its vocabulary holds: config.vocab_size less cfx.models.pad_vocab's padding
    logits_axis: str | None    # the mesh axis its logits' last dim is split over (a vocabulary-parallel head)
    batch_axes: tuple          # the logical axes of its batch's leading leaves (default ("batch", "length"))
    param_specs: Any           # its params' specs over the plan's mesh (a P or a pytree prefix), instead of
                               # those its logical axes get from the plan's rules (a LossModel's ``specs=``)
    frozen: Any                # weights it reads and never trains, as held now (``models.frozen``)

    def sublayers(self) -> dict: ...  # its named layers around the blocks, which with_layers(**) replaces: a
                                      # "sequence" (WholeSequence) says it can split its sequence, a "loss" its
                                      # token loss; tensor and sequence parallelism swap in their split forms
    def with_layers(self, **layers: Any) -> Any: ...
    def check_train_batch(self, batch: tuple, where: str) -> None: ...  # a batch of its own (not tokens)
    def tensor_parallel(self, axis: str) -> Any: ...  # its own split over a model axis (not TransformerBlocks)
    def place_frozen(self, placer: Any) -> Any: ...  # itself over its frozen weights placed by a Plan's placer
    def hidden(self, params: Any, tokens: Any, **kw: Any) -> Any: ...  # a decoder's last block's output (B, T, C)
    def logits(self, params: Any, x: Any) -> Any: ...  # ... and its head's logits of it: what serving reads


HOOKS = frozenset(Hooks.__annotations__) | {"check_train_batch", "tensor_parallel", "sublayers", "with_layers",
                                            "place_frozen", "hidden", "logits"}


def hook(model: Any, name: str, default: Any = None) -> Any:
    """``model``'s hook ``name`` (a ``Hooks`` member), or ``default`` when it has none."""
    assert name in HOOKS, f"{name!r} is not a member of the model protocol's Hooks (cfx/_src/models/parts.py)"
    return getattr(model, name, default)


def max_length(model: Any) -> int | None:
    """The longest sequence ``model`` takes: its config's field that ``max_len_name`` names (None: no bound)."""
    name = hook(model, "max_len_name")
    return getattr(hook(model, "config"), name, None) if name else None


def vocab_size(model: Any) -> int:
    """The ids ``model``'s vocabulary holds (a padded vocabulary's real size: ``cfx.models.pad_vocab``)."""
    return hook(model, "real_vocab_size") or hook(model, "config").vocab_size


def has_hook(model: Any, name: str) -> bool:
    assert name in HOOKS, f"{name!r} is not a member of the model protocol's Hooks (cfx/_src/models/parts.py)"
    return hasattr(model, name)


def sequence_part(model: Any) -> Any:
    """The model's ``"sequence"`` sublayer -- ``WholeSequence``, or the split sequence parallelism
    swapped in -- or None where it cannot split its sequence."""
    sublayers = hook(model, "sublayers")
    return sublayers().get("sequence") if callable(sublayers) else None


def parts_of(model: Any, where: str) -> ModelParts:
    """``model.parts()``, or a ValueError naming the protocol when the model does not speak it."""
    parts = getattr(model, "parts", None)
    if not callable(parts) or not isinstance(getattr(model, "blocks", None), tuple):
        raise ValueError(f"{where}: {type(model).__name__} does not implement the parts protocol "
                         "(a `blocks` tuple, `map_blocks` and `parts()` -> cfx.models.ModelParts; see "
                         "cfx/_src/models/parts.py). Implement it, or drop the pipe axis.")
    out = parts()
    if not isinstance(out, ModelParts):
        raise ValueError(f"{where}: {type(model).__name__}.parts() returned {type(out).__name__}, not "
                         "cfx.models.ModelParts.")
    return out
