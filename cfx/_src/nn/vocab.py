"""A language model's vocabulary layers as parts a parallel strategy swaps in: the token loss, and the
embedding table, tied head, untied head and loss with the vocabulary split over a mesh axis
(Megatron-LM's vocabulary parallelism). A model builds ``TokenLoss`` among its sublayers (named
``"loss"``); ``cfx.parallel.tensor_parallel`` replaces it and every vocabulary table / head with
their split forms (``model.with_layers``), so the model's own code never branches on a split."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.lax import collectives as lax
from cfx._src.nn.embedding import Embedding, vocab_parallel_embed
from cfx._src.nn.loss import (IGNORE_INDEX, cross_entropy, mean_over_sequence, vocab_parallel_cross_entropy,
                              vocab_range_start)


@dataclasses.dataclass(frozen=True)
class TokenLoss:
    """The mean cross-entropy (fp32) of logits ``(B, T, V)`` against targets ``(B, T)`` (-100 ignored);
    ``fusable``: the head's matmul and this loss may run fused (``cfx_kernels.linear_cross_entropy``)."""

    fusable = True
    logits_axis = None  # the logits are whole

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets)


@dataclasses.dataclass(frozen=True)
class VocabParallelLoss:
    """``TokenLoss`` of this rank's logits shard ``(B, T, V/n)``, the vocabulary split over ``axis``."""

    axis: str
    fusable = False

    @property
    def logits_axis(self) -> str:
        return self.axis

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.axis)


@dataclasses.dataclass(frozen=True)
class SequenceMeanLoss:
    """``inner``'s mean over this rank's share of the positions made the mean over every rank's tokens
    (the sequence split over ``axis``)."""

    inner: Any
    axis: str
    fusable = False

    @property
    def logits_axis(self) -> str | None:
        return self.inner.logits_axis

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.inner(logits, targets)
        count = (targets != IGNORE_INDEX).sum()
        return mean_over_sequence(torch.where(count > 0, loss, 0.0), count, self.axis)


@dataclasses.dataclass(frozen=True)
class PaddedVocab:
    """A vocabulary of ``size`` ids whose tables were padded past it (``cfx.models.pad_vocab``: to split
    evenly over a mesh axis): the logits of the padded ids are the dtype's lowest value, so their
    probability is exactly 0 -- the loss, greedy choices and samples are those of the unpadded
    vocabulary -- and they pass no gradient back (a model's ``"vocab_pad"`` sublayer)."""

    size: int

    def mask(self, logits: torch.Tensor, axis: str | None = None) -> torch.Tensor:
        """``logits (..., V)`` with the padded ids' columns masked; ``axis``: the logits are this rank's
        shard ``(..., V/n)`` of a vocabulary split over it (each rank's ids start at its offset)."""
        v_local = logits.shape[-1]
        ids = torch.arange(v_local, device=logits.device)
        if axis is not None:
            ids = ids + vocab_range_start(v_local, axis)
        return logits.masked_fill(ids >= self.size, torch.finfo(logits.dtype).min)


@dataclasses.dataclass(frozen=True)
class VocabParallelEmbedding:
    """``table`` with its rows split over ``axis``: ``apply`` looks this rank's rows up and sums over
    ``axis`` (``vocab_parallel_embed``); ``attend``, the tied head, gives this rank's logits shard
    ``(..., V/n)``, its input marked varying over ``axis`` so its gradient sums over the shards."""

    table: Embedding
    axis: str

    def init(self, key: torch.Tensor) -> dict:
        return self.table.init(key)

    def axes(self) -> dict:
        return self.table.axes()

    def apply(self, params: dict, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(params["w"], ids, self.axis)

    def attend(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        return self.table.attend(params, lax.pvary(x, self.axis))


@dataclasses.dataclass(frozen=True)
class VocabParallelHead:
    """An untied output head ``head`` (``(..., C) -> (..., V)``) with its output columns split over
    ``axis``: this rank's logits shard, its input marked varying over ``axis``."""

    head: Any
    axis: str

    def init(self, key: torch.Tensor) -> dict:
        return self.head.init(key)

    def axes(self) -> dict:
        return self.head.axes()

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        return self.head.apply(params, lax.pvary(x, self.axis))


def vocab_parallel_layers(layers: dict, axis: str, *, where: str = "tensor_parallel") -> dict:
    """The replacements that split a model's vocabulary over ``axis``, from its sublayers ``layers``:
    every table whose rows are the vocabulary (an ``Embedding`` whose first logical axis is
    ``"vocab"``), every head whose outputs are (a layer whose weight's last logical axis is), and its
    ``"loss"``. Empty where the model has no vocabulary; a ValueError where it has vocabulary tables
    but no token loss over them (a classifier's head: its logits are no vocabulary to split)."""
    out: dict[str, Any] = {}
    for name, layer in layers.items():
        w = (layer.axes().get("w") if callable(getattr(layer, "axes", None)) else None) or ()
        if isinstance(layer, Embedding) and w[:1] == ("vocab",):
            out[name] = VocabParallelEmbedding(layer, axis)
        elif not isinstance(layer, Embedding) and w[-1:] == ("vocab",):
            out[name] = VocabParallelHead(layer, axis)
    if not out:
        return {}
    loss = layers.get("loss")
    token = loss.inner if isinstance(loss, SequenceMeanLoss) else loss  # (a split sequence's mean around it)
    if not isinstance(token, TokenLoss):
        raise ValueError(f"{where}: the vocabulary tables {sorted(out)} have no token loss over them (a "
                         "classifier's head, e.g. Bert with head='classify', has no vocabulary to split; an MLM "
                         "head='mlm' has); split the blocks alone: tensor_parallel(model, vocab=False).")
    split = VocabParallelLoss(axis)
    return {**out, "loss": SequenceMeanLoss(split, loss.axis) if isinstance(loss, SequenceMeanLoss) else split}


def split_sequence_layers(layers: dict, split: Any) -> dict:
    """The replacements that split a model's sequence as ``split`` (a ``cfx.parallel.SequenceSplit``):
    its ``"sequence"``, and its token loss made the mean over every rank's tokens."""
    out: dict[str, Any] = {"sequence": split}
    if layers.get("loss") is not None:
        out["loss"] = SequenceMeanLoss(layers["loss"], split.axis)
    return out
