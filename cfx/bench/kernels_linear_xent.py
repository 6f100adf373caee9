"""Fused linear + cross-entropy (``cfx_kernels.linear_cross_entropy``) against the unfused loss
``F.cross_entropy(F.linear(hidden, weight).float(), targets)``, forward + backward (gradients of
hidden and weight), both on the same inputs.

``linear_xent_peak_vs_unfused``: fused peak / unfused peak, bytes above what was allocated before
the step. On CPU the bytes are those of the op outputs live at once (``cfx.memory.track_ops``:
every tensor an op returns, counted until its storage is freed; the inputs are not counted, the
allocator's caching is not seen), fp32, with the chunk size in the row's name. On CUDA
``torch.cuda.max_memory_allocated`` over the step, bf16, at the default chunk size.

``linear_xent_time_vs_unfused``: fused / unfused median step time (information: the fused loss
does the same matmuls in chunks, and on CPU its reference path walks each chunk's logits a few
more times). On CUDA, when ``liger_kernel`` is importable, ``linear_xent_time_vs_liger`` times
Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` on the same inputs; without it the row is
left out and a line on stderr says so, as GPU rows are left out on a machine without CUDA.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Callable

import torch
import torch.nn.functional as F

import cfx
from cfx.bench.common import Row, interleaved_medians
from cfx_kernels.linear_cross_entropy import linear_cross_entropy

CPU_SIZES = {  # size -> (rounds, N, C, V, chunk_size)
    "smoke": (1, 64, 32, 512, 16),
    "quick": (3, 1024, 128, 32000, 128),
    "full": (5, 4096, 256, 50257, 512),
}
CUDA_SIZES = {  # size -> (rounds, N, C, V); the chunk size is the default
    "smoke": (2, 4096, 2048, 50257),
    "quick": (5, 8192, 4096, 128256),
    "full": (20, 16384, 4096, 128256),
}


def _inputs(N: int, C: int, V: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, C, generator=g).to(device=device, dtype=dtype)  # (N, C)
    w = (torch.randn(V, C, generator=g) * C ** -0.5).to(device=device, dtype=dtype)  # (V, C)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    return h.requires_grad_(), w.requires_grad_(), t


def _unfused(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _step(loss_fn: Callable, h, w, t, sync: Callable[[], None] = lambda: None) -> Callable[[], None]:
    def step():
        h.grad = w.grad = None
        loss_fn(h, w, t).backward()
        sync()
    return step


def _ratio_rows(device: str, shape: str, peaks: dict, times: dict) -> list[Row]:
    ratio = peaks["fused"] / peaks["unfused"]
    return [Row(f"{device} linear_xent fwd+bwd {shape} peak, fused", peaks["fused"] / 2**20, "MiB"),
            Row(f"{device} linear_xent peak, unfused", peaks["unfused"] / 2**20, "MiB"),
            Row(f"{device} linear_xent_peak_vs_unfused: fused / unfused peak", ratio, "x", "<= 0.5",
                ratio <= 0.5),
            Row(f"{device} linear_xent_time_vs_unfused: fused / unfused time",
                times["fused"] / times["unfused"], "x")]


def cpu_rows(size: str) -> list[Row]:
    rounds, N, C, V, chunk = CPU_SIZES[size]
    h, w, t = _inputs(N, C, V, "cpu", torch.float32)
    fns = {"fused": lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk, impl="reference"),
           "unfused": _unfused}
    peaks = {}
    for name, fn in fns.items():
        with cfx.memory.track() as mem, mem.track_ops():
            _step(fn, h, w, t)()
        peaks[name] = mem.peak("device")
    t_fused, t_unfused = interleaved_medians([_step(fn, h, w, t) for fn in fns.values()], rounds=rounds)
    shape = f"fp32 N={N} C={C} V={V} chunk={chunk} (op outputs)"
    return _ratio_rows("cpu", shape, peaks, {"fused": t_fused, "unfused": t_unfused})


def _cuda_peak(step: Callable[[], None], *leaves: torch.Tensor) -> int:
    step()  # warm: Triton compiles, cuBLAS picks its kernels
    for x in leaves:  # the warm step's gradients are not this step's memory
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    return torch.cuda.max_memory_allocated() - base


def _liger() -> Callable | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()

    def fn(h, w, t):
        out = loss(w, h, t)  # Liger takes the weight first
        return out[0] if isinstance(out, tuple) else out
    return fn


def cuda_rows(size: str) -> list[Row]:
    rounds, N, C, V = CUDA_SIZES[size]
    h, w, t = _inputs(N, C, V, "cuda", torch.bfloat16)
    fns = {"fused": lambda h, w, t: linear_cross_entropy(h, w, t, impl="triton"), "unfused": _unfused}
    liger = _liger()
    if liger is not None:
        fns["liger"] = liger
    else:
        print("kernels: linear_xent_time_vs_liger skipped: liger_kernel is not importable", file=sys.stderr)
    steps = {name: _step(fn, h, w, t, torch.cuda.synchronize) for name, fn in fns.items()}
    peaks = {name: _cuda_peak(step, h, w) for name, step in steps.items()}
    times = dict(zip(steps, interleaved_medians(list(steps.values()), rounds=rounds)))
    rows = _ratio_rows("cuda", f"bf16 N={N} C={C} V={V}", peaks, times)
    rows += [Row("cuda linear_xent fused step", times["fused"] * 1e3, "ms"),
             Row("cuda linear_xent unfused step", times["unfused"] * 1e3, "ms")]
    if liger is not None:
        ratio = times["fused"] / times["liger"]
        rows += [Row("cuda linear_xent Liger step", times["liger"] * 1e3, "ms"),
                 Row("cuda linear_xent Liger peak", peaks["liger"] / 2**20, "MiB"),
                 Row("cuda linear_xent_time_vs_liger: fused / Liger time", ratio, "x", "<= 1", ratio <= 1.0)]
    return rows


def rows(size: str) -> list[Row]:
    out = cpu_rows(size)
    if torch.cuda.is_available():
        out += cuda_rows(size)
    return out
