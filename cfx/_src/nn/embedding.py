"""``Embedding``: a lookup table ``w`` of shape ``(num_embeddings, features)``, whole or with its rows
split over a mesh axis (``vocab_parallel_embed``, Megatron-LM)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cfx._src.lax import collectives as lax
from cfx._src.nn.linear import init_normal
from cfx._src.nn.loss import vocab_range_start


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


def vocab_parallel_embed(w_local: torch.Tensor, tokens: torch.Tensor, axis: str) -> torch.Tensor:
    """Rows of the full embedding for ``tokens`` (B, T) from this rank's shard (V/n, C): (B, T, C)."""
    v_local = w_local.shape[0]
    local = tokens - vocab_range_start(v_local, axis)
    mine = (local >= 0) & (local < v_local)
    e = F.embedding(local.clamp(0, v_local - 1), w_local) * mine[..., None].to(w_local.dtype)
    return lax.psum(e, axis)
