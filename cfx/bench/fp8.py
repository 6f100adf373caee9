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
and are no measure of float8's speed (that is the GPU issue's ``fp8_vs_bf16_step_gpu``).
"""
from __future__ import annotations

import json
import statistics
import time

import torch

import cfx
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
