"""The *parts protocol*: how a model says it splits around a chain of blocks.

The pipeline, ``cfx.parallel.Plan`` and auto-parallel never name a model family; they read

    model.blocks            a tuple of layers with ``init`` / ``apply(p, x, mask=, key=)`` / ``axes``
    model.map_blocks(f)     the same model with every block replaced by ``f(block)``
    model.axes()            logical axis names, shaped like ``model.init``'s params
    model.parts()           -> ModelParts (below): what runs before and after the blocks

A model's params are a dict whose ``"blocks"`` entry is the list of block params; every other
top-level entry belongs to the embedding (``first``), the head (``last``) or both (a tied
embedding). ``embed`` maps inputs to the first block's input ``(B, T, C)``; ``head_loss`` maps the
last block's output to the scalar loss. A family opts in by defining ``parts()``: GPT-2 and Llama
do, and so must every new family that wants pipeline stages.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

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

    @property
    def tied(self) -> tuple[str, ...]:
        """Top-level params used by both the embedding and the head."""
        return tuple(k for k in self.first if k in self.last)


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
