"""``python -m cfx.bench plans``: Plans on 8 local ranks -- step time, per-rank bytes measured
against ``Plan.describe``, bytes sent per axis.

For each plan the model state one rank books while a step runs (``cfx.memory``: params, grads
and optimizer state as the step watches them, on the device or, offloaded, on the host) is set
against what ``plan.describe(model)`` computed before anything ran (target 0.9-1.1), beside
the rank's device peak (model state, gathered blocks, chunk copies; activations are not booked), and the counted collectives of one step
(``cfx.comm_stats``) give the payload bytes a rank hands to collectives per mesh axis. ``--quick``: GPT-2
tiny-shaped (4 blocks of 128, byte vocabulary, batch 16 x 64); full: GPT-2 small's blocks with a 1024 vocabulary,
batch 8 x 128; ``--smoke``: two of the plans, 2 blocks of 32, batch 8 x 16, one step.
"""
from __future__ import annotations

import time

import torch

import cfx
from cfx.bench.common import Row, report, size_of

PLANS = (
    "data=8",
    "data=8 zero=3",
    "data=2,model=4 zero=1",
    "pipe=2,data=2,model=2 zero=1 remat=blocks microbatches=2",
    "pipe=2,data=2,model=2 zero=3 microbatches=2",
    "pipe=2,data=4 zero=2 schedule=interleaved microbatches=2",
    "pipe=2,data=2,model=2 zero=3 offload=host microbatches=2",
)
SMOKE_PLANS = (PLANS[0], PLANS[-1])  # the simplest and the one with the most parts; each plan is one measure()


def _setup(size: str):
    """(model, batch, seq, steps timed)."""
    if size == "smoke":
        return cfx.models.gpt2("tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16), 8, 16, 1
    if size == "quick":
        return cfx.models.gpt2("tiny", vocab_size=256, n_positions=64), 16, 64, 3
    return cfx.models.gpt2("small", vocab_size=1024, n_positions=128), 8, 128, 2


def measure(text: str, model, batch: int, seq: int, steps: int) -> dict:
    plan = cfx.parallel.Plan.parse(text)
    described = plan.describe(model)
    tokens = cfx.random.randint(cfx.random.key(1), (steps + 1, batch, seq + 1), 0, model.config.vocab_size)
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state, _ = step(step.init(cfx.random.key(0)), (tokens[0, :, :-1], tokens[0, :, 1:]))  # warm-up
        times = []
        for i in range(1, steps + 1):
            t0 = time.perf_counter()
            state, metrics = step(state, (tokens[i, :, :-1], tokens[i, :, 1:]))
            float(metrics["loss"])
            times.append(time.perf_counter() - t0)
        with cfx.memory.track() as mem, cfx.comm_stats() as stats:
            state, _ = step(state, (tokens[0, :, :-1], tokens[0, :, 1:]))
        measured = max(sum(mem.peak_by_kind(tier, rank=r).get(k, 0) for tier in ("device", "host", "nvme")
                           for k in ("param", "grad", "optim")) for r in mesh.local_ranks)
        device = max(mem.peak("device", rank=r) for r in mesh.local_ranks)
        sent: dict[str, int] = {}  # collective payload bytes per mesh axis (group), mean per rank
        for r in stats.records:
            key = ".".join(r.axes)
            sent[key] = sent.get(key, 0) + r.nbytes
        ranks = len(mesh.local_ranks)
    return dict(plan=text, step_s=sorted(times)[len(times) // 2], measured=measured, device=device,
                described=described.model_state, sent={a: b / ranks for a, b in sent.items()})


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    model, batch, seq, steps = _setup(size)
    torch.manual_seed(0)
    rows = []
    for text in SMOKE_PLANS if size == "smoke" else PLANS:
        m = measure(text, model, batch, seq, steps)
        ratio = m["measured"] / m["described"]
        rows.append(Row(f"plan[{text}]_bytes_vs_describe", round(ratio, 4), "measured/described", "0.9-1.1",
                        0.9 <= ratio <= 1.1))
        rows.append(Row(f"plan[{text}]_step_s", round(m["step_s"], 4), "s", "info"))
        rows.append(Row(f"plan[{text}]_model_state_per_rank", round(m["measured"] / 2**20, 3), "MiB", "info"))
        rows.append(Row(f"plan[{text}]_device_peak_per_rank", round(m["device"] / 2**20, 3), "MiB", "info"))
        for axis, b in sorted(m["sent"].items()):
            rows.append(Row(f"plan[{text}]_sent[{axis}]", round(b / 2**20, 3), "MiB payload per rank per step", "info"))
    return report("plans", rows, json_path)
