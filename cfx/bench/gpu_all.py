"""``python -m cfx.bench gpu --all [--json FILE]``: every figure that needs a GPU, in one call that fits a
device lease (under 8 minutes on one H200, cold).

Sections, most wanted first, each timed and skipped (never faked) once the deadline would pass:
float8 (``fp8.gpu_rows``: the matmul's TFLOP/s, a GPT-2 large step against bf16's), training (``gpu.training_rows``), generation (``gpu_generate``, without the int8 and HF static-cache
extras), attention (T 512 / 2048 / 8192, D 64 / 128) and the backward's tile sweep, norms and adamw,
linear cross-entropy (against Liger where it is importable), ZeRO-3 on NCCL against gloo, a LoRA step
against peft, the serving engine's paged kernel against its reference, a GPT-2 medium step (what the
cluster estimate is checked on), then every ``gpu``-marked test (pytest, in a subprocess, with what time
is left). The JSON is rewritten after each section, so a run cut short still returns what it measured.
A section that raises becomes a failed row with the error; the rest still run.

``CFX_GPU_ONLY="training,attention"`` runs only the sections named (a second call in the same lease, after a
fix, measures what changed).

Without CUDA every section says so in one skipped row; ``--smoke`` runs the sections that can run on the
CPU at toy sizes (the measuring code, not figures), so the command is dry-run where it is written.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from typing import Callable

import torch

from cfx.bench import fp8, gpu, gpu_generate, kernels_attention, kernels_linear_xent, kernels_misc, lora, serve, zero
from cfx.bench.common import Row, report, skipped, write_json

DEADLINE_S = 460.0  # every section's, the tests' included: a device call of 9 minutes with the machine's start
TESTS_S = 100.0  # at most, for the gpu-marked tests
# the whole gpu bench at quick size: the training, generation and kernel sections measure the same rows
DESELECT = "cfx_tests/test_bench_gpu.py::test_on_a_gpu_every_row_is_measured"


def gpu_tests(timeout_s: float) -> list[Row]:
    """Every ``gpu``-marked test, in a subprocess with ``timeout_s``: one row with passed / failed counts."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "8",
           "-p", "no:benchmark", "--timeout", "120", "--deselect", DESELECT, "cfx_tests"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-300:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-300:]
        return [Row(f"gpu-marked tests: timed out after {timeout_s:.0f} s ({tail!r})", 0.0, "tests", "all pass", False)]
    print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-200:]
    return [Row(f"gpu_tests_pass ({last.strip('= ')}; {DESELECT.split('::')[1]} deselected: its rows are this run's)",
                float(done.returncode == 0), "", "all pass", done.returncode == 0)]


def sections(cuda: bool) -> list[tuple[str, float, Callable[[float], list[Row]]]]:
    """(name, seconds it needs at least, its rows given the seconds left) in the order they run: what no
    lease has measured yet first (the tests, NCCL), the issue's rows, then the backward's tile sweep (what
    tuning reads) with the time left. On the H200 (2026-11-28) training took 300 s, 230 of them
    compiling ``cfx.jit``'s step: with every section, more than one call's 8 minutes (``CFX_GPU_ONLY``)."""
    dev = "cuda" if cuda else "cpu"
    size = "full" if cuda else "smoke"
    out = [
        ("zero3 nccl", 15, lambda left: zero.nccl_rows(smoke=not cuda)),
        ("fp8", 40, lambda left: fp8.gpu_rows(dev, smoke=not cuda)),
        ("training", 120, lambda left: gpu.training_rows(size, dev)),
        ("generation", 60, lambda left: gpu_generate.rows(size, dev, extras=False)),
        ("lora vs peft", 20, lambda left: lora.peft_rows(dev, smoke=not cuda)),
        ("serve", 30, lambda left: serve.device_rows("full" if cuda else "smoke", dev)),
        ("gpt2 medium", 30, lambda left: gpu.medium_rows(dev, smoke=not cuda)),
    ]
    if cuda:
        out.insert(0, ("gpu tests", 40, lambda left: gpu_tests(min(TESTS_S, left))))
        out[4:4] = [("attention", 30, lambda left: kernels_attention.cuda_rows("quick", (512, 2048, 8192), (64, 128))),
                    ("norms, adamw", 15, lambda left: kernels_misc.cuda_rows("quick")),
                    ("linear cross-entropy", 15, lambda left: kernels_linear_xent.cuda_rows("quick"))]
        out.append(("attention tiles", 20,
                    lambda left: kernels_attention.tile_sweep_rows(deadline=time.perf_counter() + left)))
    return out


def run_all(*, smoke: bool = False, json_path: str | None = None, deadline_s: float = DEADLINE_S) -> dict:
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    import triton
    rows = [Row(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
                f"triton {triton.__version__}", 0.0, "-")]
    if not cuda and not smoke:
        rows += [skipped(f"gpu --all: {name}") for name, _, _ in sections(True)]
        return report("gpu_all", rows, json_path)

    def save():
        if json_path:
            write_json("gpu_all", rows, json_path)

    only = [n.strip() for n in os.environ.get("CFX_GPU_ONLY", "").split(",") if n.strip()]
    chosen = [s for s in sections(cuda) if not only or s[0] in only]
    if only and len(chosen) != len(only):
        raise ValueError(f"CFX_GPU_ONLY={os.environ['CFX_GPU_ONLY']!r} names a section that is not one of "
                         f"{[name for name, _, _ in sections(cuda)]}.")
    for name, need_s, fn in chosen:
        left = deadline_s - (time.perf_counter() - t0)
        if left < need_s:
            rows.append(skipped(f"gpu --all: {name}", why=f"out of time ({left:.0f} s of the {deadline_s:.0f} s left)"))
            continue
        start = time.perf_counter()
        print(f"[gpu --all] {name} ({time.perf_counter() - t0:.0f} s in)", file=sys.stderr, flush=True)
        try:
            rows += fn(left)
        except Exception as e:  # noqa: BLE001 -- one section's failure is a row; the others still measure
            traceback.print_exc()
            rows.append(Row(f"gpu --all: {name} FAILED: {type(e).__name__}: {str(e)[:160]}", 0.0, "error", "runs", False))
        rows.append(Row(f"  [{name}: {time.perf_counter() - start:.0f} s]", time.perf_counter() - start, "s"))
        if cuda:
            torch.cuda.empty_cache()
        save()
    rows.append(Row("gpu --all wall time", time.perf_counter() - t0, "s", "<= 480", time.perf_counter() - t0 <= 480))
    save()
    return report("gpu_all", rows, json_path)

