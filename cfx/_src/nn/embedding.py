"""``Embedding``: a lookup table ``w`` of shape ``(num_embeddings, features)``."""
from __future__ import annotations

import dataclasses

import torch

from cfx._src.nn.linear import init_normal


@dataclasses.dataclass(frozen=True)
class Embedding:
    """Row lookup ``w[ids]``; ``attend`` is the tied output head ``x @ w.T``."""

    num_embeddings: int
    features: int
    axes_names: tuple[str, str] = ("vocab", "embed")
    init_std: float = 0.02

    def init(self, key: torch.Tensor) -> dict:
        return {"w": init_normal(key, (self.num_embeddings, self.features), self.init_std)}

    def apply(self, params: dict, ids: torch.Tensor) -> torch.Tensor:
        # (...) int -> (..., features)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"Embedding.apply: ids must be an integer tensor, got dtype {ids.dtype}.")
        return torch.nn.functional.embedding(ids, params["w"])

    def attend(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        # (..., features) -> (..., num_embeddings)
        return x @ params["w"].T

    def axes(self) -> dict:
        return {"w": tuple(self.axes_names)}
