"""Rotary position embeddings in Hugging Face Llama's ``rotate_half`` convention.

Dim ``i`` of the first half of each head is paired with dim ``i + D/2`` (not interleaved pairs),
so HF Llama checkpoints load without permuting the q / k projections.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, *, theta: float = 10000.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables for integer ``positions`` ``(T,)`` or ``(B, T)``: ``(..., T, D)``.

    Angles are computed in fp32 and then cast to ``dtype``.
    """
    if head_dim % 2:
        raise ValueError(f"rope_cos_sin: head_dim must be even for rotary embeddings, got {head_dim}.")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))  # (D/2,)
    freqs = positions[..., None].float() * inv_freq  # (..., T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by tables ``(T, D)`` or ``(B, T, D)`` from ``rope_cos_sin``."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, D), broadcast over heads
    return x * cos + rotate_half(x) * sin
