"""``python -m cfx.bench fp8``: FP8 training against bf16 on byte data, three seeds each.

A GPT-2 of width 128 and 6 layers learns the bytes of Python's standard library (``train.data.stdlib_corpus``)
for 300 steps of 8 x 128 bytes under the single-device Plan, with ``precision=bf16`` and with each float8
recipe (``fp8:tensorwise``, ``fp8:rowwise``, ``fp8:rowwise_gw_hp``, and ``fp8:delayed``: tensorwise with
Transformer Engine's delayed scaling), each with seeds 0, 1 and 2 (the seed
sets the init and the batches, the same for every precision). The final loss of a run is its mean eval
loss over 16 held-out batches, the same batches for every run (so the spread is the training's, not the
held-out sample's).

A recipe's row is ok when the mean of its three final losses is within twice bf16's spread over its
seeds (the largest minus the smallest final loss) of bf16's mean: float8 changes the loss no more than
the seed does. The loss curves (every step's train loss) go beside the JSON (``X.curves.json``) for the notebook's plot.
On the CPU the float8 GEMMs run through ``torch._scaled_mm``'s reference kernels: the seconds are printed,
and are no measure of float8's speed: that is ``gpu_rows``' (``fp8_vs_bf16_step_gpu`` and the float8 matmul's
TFLOP/s), measured in ``python -m cfx.bench gpu --all``'s "fp8" section.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import torch

import cfx
from cfx._src.nn.fp8 import E4M3, scale_of, to_fp8
from cfx._src.train.data import run_keys, sample_batch, stdlib_corpus, train_val_split
from cfx.bench.common import Row, report, size_of

PRECISIONS = ("bf16", "fp8:tensorwise", "fp8:rowwise", "fp8:rowwise_gw_hp", "fp8:delayed")
HELD_OUT = 1234  # the seed of the held-out batches
SIZES = {  # width, layers, batch, bytes per row, steps, seeds, eval batches
    "smoke": (32, 2, 2, 32, 3, (0, 1), 2),
    "quick": (64, 4, 8, 64, 60, (0, 1, 2), 8),
    "full": (128, 6, 8, 128, 300, (0, 1, 2), 16),
}


def train(precision: str, seed: int, size: str) -> dict:
    """One run: ``{"losses": every step's train loss, "final": mean eval loss, "seconds"}``."""
    width, layers, batch, length, steps, _, evals = SIZES[size]
    model = cfx.models.gpt2("tiny", n_layer=layers, n_embd=width, n_head=4, vocab_size=256, n_positions=length)
    train_data, val_data = train_val_split(stdlib_corpus(4 << 20))
    keys = run_keys(seed)
    step = cfx.parallel.Plan.parse(f"precision={precision}").step(
        model, cfx.optim.adamw(cfx.optim.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 10), steps), weight_decay=0.01))
    state, losses = step.init(keys.init), []
    start = time.perf_counter()
    for i in range(steps):
        state, m = step(state, sample_batch(train_data, cfx.random.fold_in(keys.data, i), batch, length))
        losses.append(float(m["loss"]))
    seconds = time.perf_counter() - start
    val = run_keys(HELD_OUT).val  # (every run's held-out batches the same)
    final = statistics.fmean(step.loss(state, *sample_batch(val_data, cfx.random.fold_in(val, i), batch, length))
                             for i in range(evals))
    return {"losses": losses, "final": final, "seconds": seconds}


def run(quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    seeds = SIZES[size][5]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = {p: [train(p, s, size) for s in seeds] for p in PRECISIONS}
    finals = {p: [r["final"] for r in rs] for p, rs in runs.items()}
    mean = {p: statistics.fmean(f) for p, f in finals.items()}
    spread = max(finals["bf16"]) - min(finals["bf16"])
    rows = [Row("bf16_final_loss_mean", mean["bf16"], "nats/byte", f"{len(seeds)} seeds"),
            Row("bf16_final_loss_spread", spread, "nats/byte", "max - min over the seeds")]
    for p in PRECISIONS[1:]:
        gap = abs(mean[p] - mean["bf16"])
        rows.append(Row(f"{p}_final_loss_mean", mean[p], "nats/byte", f"{len(seeds)} seeds"))
        rows.append(Row(f"{p}_gap_vs_bf16", gap, "nats/byte", f"<= 2 x spread = {2 * spread:.4f}",
                        gap <= 2 * spread))
    for p in PRECISIONS:
        rows.append(Row(f"{p}_seconds_per_step_cpu", statistics.fmean(r["seconds"] for r in runs[p]) / SIZES[size][4],
                        "s", "printed (CPU reference kernels)"))
    out = report("fp8", rows, json_path)
    if json_path:  # the curves beside the rows, for the notebook's plot
        with open(curves_path(json_path), "w") as f:
            json.dump({"curves": {p: [r["losses"] for r in rs] for p, rs in runs.items()}, "finals": finals}, f)
    return out


def curves_path(json_path: str) -> str:
    """Where ``run`` writes every run's loss curve and final loss: ``X.json`` -> ``X.curves.json``."""
    return json_path[:-5] + ".curves.json" if json_path.endswith(".json") else json_path + ".curves.json"


# -- the rows of the GPU run (``python -m cfx.bench gpu --all``'s "fp8" section) --------------------------------
def _timed(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Median seconds of ``fn`` after a warm-up (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rows(device: str, *, smoke: bool = False) -> list[Row]:
    """``torch._scaled_mm`` on e4m3 operands with tensor-wise scales (what the tensorwise recipe's output GEMM
    runs) at 4096 x 8192 x 16384, in TFLOP/s, beside bf16's ``a @ b``."""
    M, K, N = (64, 64, 64) if smoke else (4096, 8192, 16384)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16, generator=g)
    sa, sb = scale_of(a, E4M3), scale_of(b, E4M3)
    a8, b8 = to_fp8(a, E4M3, sa), to_fp8(b, E4M3, sb).t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    reps = 3 if smoke else 20
    fp8_s = _timed(lambda: torch._scaled_mm(a8, b8, scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16), device, reps)
    bf16_s = _timed(lambda: a @ b, device, reps)
    tag = "" if device == "cuda" else " [cpu smoke]"
    flops = 2 * M * K * N
    return [Row(f"fp8_matmul_tflops_gpu ({M} x {K} x {N}, e4m3, tensor-wise scales, bf16 out){tag}",
                flops / fp8_s / 1e12, "TFLOP/s", "printed (H100 dense e4m3 peak 1,979)"),
            Row(f"bf16_matmul_tflops_gpu ({M} x {K} x {N}){tag}", flops / bf16_s / 1e12, "TFLOP/s", "printed"),
            Row(f"fp8_matmul_vs_bf16_gpu{tag}", bf16_s / fp8_s, "x", "printed (peaks: 2x)")]


def step_rows(device: str, *, smoke: bool = False) -> list[Row]:
    """``fp8_vs_bf16_step_gpu``: GPT-2 large's training step on one GPU, B8 x 1024, eager, AdamW, bf16 against
    ``precision=fp8`` (tensorwise): tokens/s of fp8 over bf16's. Random weights (the step's time, not its loss)."""
    kw, (B, T), steps = (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32), (2, 32), 2) if smoke \
        else ({}, (8, 1024), 10)
    model = cfx.models.gpt2("tiny" if smoke else "large", **kw)
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    params = cfx.tree.map(lambda s: torch.randn(s.shape, device=device) * 0.02, shapes)
    tokens = torch.randint(0, model.config.vocab_size, (B, T + 1), device=device)
    tx, seconds = cfx.optim.adamw(1e-4), {}
    for precision in ("bf16", "fp8"):
        policy = cfx.amp.policy(precision)
        m = cfx.amp.float8(model, policy.fp8) if policy.fp8 else model
        box = [cfx.tree.map(torch.clone, params), None]
        box[1] = tx.init(box[0])

        def step(m=m, policy=policy):
            loss, grads = cfx.value_and_grad(lambda p: m.loss(policy.cast_to_compute(p), tokens[:, :-1], tokens[:, 1:]))(
                box[0])
            box[0], box[1] = cfx.optim.apply_gradients(tx, grads, box[1], box[0])
        seconds[precision] = _timed(step, device, steps)
        del box
    ratio = seconds["bf16"] / seconds["fp8"]
    tag = "" if device == "cuda" else " [cpu smoke]"
    return [Row(f"fp8_vs_bf16_step_gpu (GPT-2 {'tiny' if smoke else 'large'} B{B}x{T}, eager: bf16 {seconds['bf16']:.3f} s, "
                f"fp8 {seconds['fp8']:.3f} s a step){tag}", ratio, "x tokens/s", ">= 1.2", ratio >= 1.2 or bool(tag))]


def gpu_rows(device: str, *, smoke: bool = False) -> list[Row]:
    """The float8 rows of the GPU run: the matmul's TFLOP/s and a GPT-2 large step against bf16's."""
    return matmul_rows(device, smoke=smoke) + step_rows(device, smoke=smoke)
