"""Which paged attention the engine runs on a GPU, measured there: ``choose(q, k_pool)``.

``Engine(attention="auto")`` on CUDA could run the Triton kernel (``cfx_kernels.paged_attention``: the
blocks read in place) or the gather-then-attend reference (``PagedStep.attend_reference``: each row's
blocks gathered, then SDPA). Which is faster depends on the GPU, the dtype and the heads, so the first
step of each kind -- a decode step (one new token a row) or a prefill (several) -- at each shape class
times both on synthetic inputs of that class (as cuDNN's benchmark mode does) and remembers the faster
for the process; ``CHOSEN`` holds each choice with its timings. Nothing is measured on a CPU, where the
kernel runs only under the Triton interpreter (for tests): there ``auto`` is the reference.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from cfx_kernels.paged_attention import paged_attention

# (device, dtype, H, Hkv, D, block_size, decode?) -> (the faster impl, {impl: seconds})
CHOSEN: dict[tuple, tuple[str, dict[str, float]]] = {}
DECODE = dict(rows=8, context=512, new=1)   # what each kind is measured on
PREFILL = dict(rows=2, context=384, new=64)


Reference = Callable[..., torch.Tensor]  # (q, k_pool, v_pool, tables, starts, lengths) -> (B, T, H, D)


def choose(q: torch.Tensor, k_pool: torch.Tensor, reference: Reference) -> str:
    """``"triton"`` or ``"reference"`` for queries like ``q`` ``(B, T, H, D)`` over a pool like ``k_pool``
    ``(NB, bs, Hkv, D)``: measured at the first call of its class (module doc), then remembered."""
    decode = q.shape[1] == 1
    key = (_device_name(q.device), q.dtype, q.shape[2], k_pool.shape[2], q.shape[3], k_pool.shape[1], decode)
    if key not in CHOSEN:
        CHOSEN[key] = measure(q.device, q.dtype, q.shape[2], k_pool.shape[2], q.shape[3], k_pool.shape[1], reference,
                              **(DECODE if decode else PREFILL))
    return CHOSEN[key][0]


def measure(device: torch.device, dtype: torch.dtype, H: int, Hkv: int, D: int, block_size: int,
            reference: Reference, *, rows: int, context: int, new: int, repeats: int = 5
            ) -> tuple[str, dict[str, float]]:
    """``(the faster impl, {impl: best seconds of repeats})`` for ``rows`` rows of ``context`` cached tokens
    and ``new`` new ones each, their blocks scattered through a pool; each impl run once to warm first
    (``reference``: the engine's gather-then-attend, ``paged.attend_reference``)."""
    g = torch.Generator().manual_seed(0)
    nb = -(-(context + new) // block_size)
    kp, vp = (torch.randn(rows * nb + 1, block_size, Hkv, D, generator=g).to(device, dtype) for _ in range(2))
    tables = torch.randperm(rows * nb + 1, generator=g)[:rows * nb].reshape(rows, nb).to(device)
    starts = torch.full((rows,), context, device=device)
    lengths = torch.full((rows,), new, device=device)
    q = torch.randn(rows, new, H, D, generator=g).to(device, dtype)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: paged_attention(q, kp, vp, tables, starts, lengths, impl="triton"),
        "reference": lambda: reference(q, kp, vp, tables, starts, lengths),
    }
    times = {name: _seconds(run, device, repeats) for name, run in runs.items()}
    return min(times, key=times.get), times


def _seconds(run: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    run()  # compiles the kernel, fills the scratch
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
