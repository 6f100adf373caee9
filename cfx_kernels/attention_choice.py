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

from cfx_kernels._common import device_capability

__all__ = ["Measured", "TABLE", "choose"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """One family's winners: ``picks[(head_dim, causal, masked)]``, ``default`` for other cases."""

    default: str
    picks: dict
    source: str


TABLE: dict[tuple[int, int], Measured] = {
    # H100 80GB and H200 (sm90), torch 2.11 + triton 3.6, bf16, causal, fwd+bwd. 2026-11-26 (MEASURED.md):
    # the Triton kernel ran at 0.55-0.59x SDPA's flash backend. 2026-11-28, H200, after its backward's
    # tiles were timed (``python -m cfx.bench gpu --all``): 0.66-1.00x flash (T 512-8192, D 64 / 128) but
    # 0.49-0.59x SDPA with torch's own backend choice (cuDNN on Hopper), which is what "sdpa" runs.
    (9, 0): Measured("sdpa", {}, "H200 fwd+bwd: Triton 0.66-1.00x SDPA flash, 0.49-0.59x SDPA (cuDNN)"),
}


def choose(q: torch.Tensor, *, causal: bool, masked: bool) -> str:
    """``"triton"`` or ``"sdpa"`` for CUDA inputs q ``(B, T, H, D)`` the Triton kernel supports."""
    family = TABLE.get(device_capability(q.device.index))
    if family is None:
        return "sdpa"
    return family.picks.get((q.shape[3], causal, masked), family.default)
