"""``python -m cfx.bench kernels``: the kernels' reference paths on CPU vs naive PyTorch, fused
linear + cross-entropy's peak memory and time vs the unfused loss, and on CUDA (when present)
attention TFLOP/s vs SDPA, norm / AdamW GB/s vs torch.compile, loss memory, fused linear +
cross-entropy vs Liger-Kernel's (when installed)."""
from __future__ import annotations

from cfx.bench import kernels_attention, kernels_linear_xent, kernels_misc
from cfx.bench.common import report, size_of


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    rows = kernels_attention.rows(size) + kernels_misc.rows(size) + kernels_linear_xent.rows(size)
    return report("kernels", rows, json_path)
