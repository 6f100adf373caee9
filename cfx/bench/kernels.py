"""``python -m cfx.bench kernels``: the kernels' reference paths on CPU vs naive PyTorch, and on
CUDA (when present) attention TFLOP/s vs SDPA, norm / AdamW GB/s vs torch.compile, loss memory."""
from __future__ import annotations

from cfx.bench import kernels_attention, kernels_misc
from cfx.bench.common import report, size_of


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    rows = kernels_attention.rows(size) + kernels_misc.rows(size)
    return report("kernels", rows, json_path)
