"""Which attention implementation ``impl="auto"`` runs on a CUDA device: the faster one, by measurement.

A small table per GPU family (the device's compute capability), filled from
``python -m cfx.bench kernels`` on that family: for each measured case (head dim, causal, masked)
the implementation that was faster forward + backward, with the measurement it rests on. A case or a
family nobody measured gets ``F.scaled_dot_product_attention``: torch picks its own fastest backend
(cuDNN, flash, memory-efficient) for the inputs, so ``auto`` is never slower than SDPA where nothing
says otherwise. The Triton kernel is chosen only where a measurement says it wins.

``choose(q, k, v, mask=, causal=)`` reads it; ``auto_vs_best`` in ``python -m cfx.bench kernels``
checks it against timings of both sides on every bench shape.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["Measured", "TABLE", "choose"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """One family's winners: ``picks[(head_dim, causal, masked)]``, ``default`` for other cases."""

    default: str
    picks: dict
    source: str


TABLE: dict[tuple[int, int], Measured] = {
    # H100 80GB and H200 (sm90), torch 2.11 + triton 3.6, bf16, causal, fwd+bwd (MEASURED.md,
    # 2026-11-26): the Triton kernel ran at 0.55-0.59x SDPA's flash backend (T 512 / 2048) and
    # 0.3-0.4x its cuDNN backend (T 2048 / 8192, D 64 and 128); its forward alone beat flash but not cuDNN.
    (9, 0): Measured("sdpa", {}, "H100/H200 fwd+bwd: Triton 0.55-0.59x SDPA flash, 0.3-0.4x cuDNN"),
}


def choose(q: torch.Tensor, *, causal: bool, masked: bool) -> str:
    """``"triton"`` or ``"sdpa"`` for CUDA inputs q ``(B, T, H, D)`` the Triton kernel supports."""
    family = TABLE.get(torch.cuda.get_device_capability(q.device))
    if family is None:
        return "sdpa"
    return family.picks.get((q.shape[3], causal, masked), family.default)
