"""A model's sequence as a part a parallel strategy swaps in: ``WholeSequence``, every position on
every rank (what a model builds among its sublayers, named ``"sequence"``); sequence parallelism
replaces it with its split (``cfx.parallel.SequenceSplit``, through ``model.with_layers``), which has
the same methods over this rank's share. So a model reads its positions, shares a whole sequence and
takes a one-token head's output through this part, and never branches on a split."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class WholeSequence:
    """The whole sequence on every rank (module doc): the identity of ``SequenceSplit``'s methods."""

    axis = None  # the mesh axis a split sequence lies over

    def rows(self, table: torch.Tensor, T: int) -> torch.Tensor:
        """The rows of a learned position table ``(P, C)`` for the ``T`` positions a call sees: the first ``T``."""
        return table[:T]

    def share(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``x (B, T, ...)`` as it is, and no key-padding mask."""
        return x, None

    def from_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (computed from position 0, e.g. a [CLS] head's) as it is."""
        return t
