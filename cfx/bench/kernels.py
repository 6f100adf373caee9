"""``python -m cfx.bench kernels``: the kernels' reference paths on CPU vs naive PyTorch, and on
CUDA (when present) attention TFLOP/s vs SDPA, norm / AdamW GB/s vs torch.compile, loss memory."""
from __future__ import annotations

from cfx.bench import kernels_attention, kernels_misc
from cfx.bench.common import report


def run(*, quick: bool = False, json_path: str | None = None) -> dict:
    rows = kernels_attention.rows(quick) + kernels_misc.rows(quick)
    return report("kernels", rows, json_path)
