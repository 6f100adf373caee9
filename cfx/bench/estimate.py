"""``python -m cfx.bench estimate``: ``cfx.parallel.estimate`` against published runs and its own speed.

- Korthikanti et al. 2022 Table 5 (seconds per iteration of 22B-1T on 8-512 A100s, full recomputation and
  sequence parallelism + selective recomputation) and Narayanan et al. 2021 Table 1 (teraFLOP/s per GPU,
  1.7B-1T on 32-3072 A100s): every row's error, their mean and worst, with one set of A100 constants
  (``cfx/_src/estimate/constants.py``). Korthikanti et al. 2022 Fig. 1: memory per GPU (parameters and
  optimizer state; activations without and with sequence parallelism + selective recomputation).
- An H200: GPT-2 medium's measured step (cfx eager, B8 x 1024 bf16, docs/MEASURED.md) against the ``h200`` preset.
- Speed: one estimate of a 1T-parameter config (its shape alone, and a cfx GPT-2 of that shape through
  the plan's own accounting), a search over every plan for GPT-3 175B on 1,024 A100s.
- The local mesh (``LOCAL_PLANS``, and in the full run every plan of ``python -m cfx.bench plans`` too): each
  plan estimated with ``rehearse=True`` holds what ``Plan.describe(batch=)`` says and sends,
  per axis and phase, the bytes ``cfx.comm_stats`` counts in the real step (exact); the activations as the
  estimate counts them without rehearsal against the rehearsal's (printed).

- Two hosts for real: two network namespaces joined by a veth pair shaped to 1 Gbit/s
  (``twohost``); gloo's all-reduce / all-gather / reduce-scatter across them against the estimate's
  collective model for that link.

- Step time on this machine: 10 plans on 8 local ranks, measured against the estimate for the ``cpu``
  cluster (``Cluster.cpu`` of ``cfx.autoshard.calibrate``), as a rank correlation; rehearsed (``rehearse=True``:
  each collective call the step makes, timed, rather than the per-layer model's few).

``--quick``: the search over 64 GPUs, 5 of the local plans; ``--smoke``: two published rows of each table, GPT-2 tiny for the
H200 row and a search over 8 GPUs, one local plan.
"""
from __future__ import annotations

import statistics
import time

import cfx
from cfx._src.estimate import published, schedule_time
from cfx.bench.common import Row, report, size_of

# cfx eager GPT-2 medium, B8 x 1024, bf16 autocast, fused AdamW, on one H200 (torch 2.11, 2026-11-28):
# ``python -m cfx.bench gpu --all`` (gpu.medium_rows), docs/MEASURED.md
H200_GPT2_MEDIUM_STEP_S = 0.0790

LOCAL_PLANS = ("data=2", "data=2 zero=3", "model=2", "model=2 sp=megatron", "data=2,model=2 remat=blocks",
               "pipe=2 microbatches=2", "seq=2")


def published_rows(size: str) -> list[Row]:
    rows = []
    for runs, target_mean, target_max, what in (
            (published.korthikanti_table5(), 0.035, 0.08, "Korthikanti 2022 Table 5 iteration time"),
            (published.narayanan_table1(), None, 0.05, "Narayanan 2021 Table 1 TFLOP/s per GPU")):
        if size == "smoke":
            runs = runs[:1] + runs[-1:]
        checked = published.check(runs)
        for run, value, err in checked:
            rows.append(Row(f"{run.source}: {run.name} ({run.plan}, batch {run.rows}): paper {run.value:g} {run.unit}, "
                            f"estimate {value:.3g}", err * 100, "% error", f"|e| <= {target_max:.0%}",
                            abs(err) <= target_max))
        errs = [abs(e) for _, _, e in checked]
        mean = statistics.mean(errs)
        rows.append(Row(f"{what}: mean |error| over {len(errs)} rows", mean * 100, "%",
                        f"<= {target_mean:.1%}" if target_mean else "", mean <= target_mean if target_mean else True))
        rows.append(Row(f"{what}: max |error|", max(errs) * 100, "%", f"<= {target_max:.0%}", max(errs) <= target_max))
    return rows


def fig1_rows(size: str) -> list[Row]:
    """Korthikanti et al. 2022 Fig. 1: memory per GPU of the four models, the estimate against the paper's
    equations that draw the figure's bars (``published.korthikanti_fig1``)."""
    bars = published.korthikanti_fig1()
    if size == "smoke":
        bars = bars[:3]
    return [Row(f"Korthikanti 2022 Fig. 1: {bar}: paper {paper / 2**30:.1f} GiB, estimate {est / 2**30:.1f} GiB",
                (est / paper - 1) * 100, "% error", "|e| <= 10%", abs(est / paper - 1) <= 0.10)
            for bar, est, paper in bars]


def h200_rows(size: str) -> list[Row]:
    model = cfx.models.gpt2("tiny", n_positions=1024) if size == "smoke" else cfx.models.gpt2("medium")
    e = cfx.parallel.estimate(model, cfx.parallel.Plan.parse("precision=bf16"), cfx.parallel.Cluster.preset("h200", 1),
                              batch=(8, 1024))
    ratio = e.step_s / H200_GPT2_MEDIUM_STEP_S
    if size == "smoke":
        return [Row("estimate_vs_measured_gpu [smoke: GPT-2 tiny, against medium's measured step]", ratio, "x")]
    return [Row(f"estimate_vs_measured_gpu: GPT-2 medium B8x1024 bf16 on one H200, estimate {e.step_s * 1e3:.1f} ms / "
                f"measured {H200_GPT2_MEDIUM_STEP_S * 1e3:.1f} ms (cfx eager)", ratio, "x", "0.90-1.10",
                0.9 <= ratio <= 1.1)]


def speed_rows(size: str) -> list[Row]:
    shape = cfx.parallel.TransformerShape.gpt(25600, 128, 160)
    plan = cfx.parallel.Plan.parse("pipe=64,data=6,model=8 zero=1 remat=dots sp=megatron microbatches=512 precision=bf16")
    cluster = cfx.parallel.Cluster.preset("a100-80gb", 3072)
    schedule_time.clear_caches()  # each a first call: no schedule or makespan remembered from the rows before
    t = time.perf_counter()
    cfx.parallel.estimate(shape, plan, cluster, batch=(3072, 2048))
    dt = time.perf_counter() - t
    rows = [Row("estimate of a 1T config (its shape), 3,072 GPUs", dt, "s", "< 1", dt < 1)]
    if size != "smoke":
        model = cfx.models.gpt2("small", n_embd=25600, n_layer=128, n_head=160, vocab_size=51200, n_positions=2048)
        schedule_time.clear_caches()
        t = time.perf_counter()
        cfx.parallel.estimate(model, plan, cluster, batch=(3072, 2048))
        dt = time.perf_counter() - t
        rows.append(Row("estimate of a cfx GPT-2 of 1T parameters (the plan's own accounting on shapes, first call)",
                        dt, "s", "< 1", dt < 1))
    gpus, rows_ = {"smoke": (8, 8), "quick": (64, 64), "full": (1024, 1536)}[size]
    model = (cfx.models.gpt2("tiny", n_positions=2048) if size == "smoke" else
             cfx.models.gpt2("small", n_embd=12288, n_layer=96, n_head=96, vocab_size=51200, n_positions=2048))
    schedule_time.clear_caches()
    found = cfx.parallel.search(model, cfx.parallel.Cluster.preset("a100-80gb", gpus), batch=(rows_, 2048))
    best = (f"best {found.best[0].plan} ({found.best[0].step_s:.3g} s, {found.best[0].mfu:.1%} MFU)" if found.best
            else "none fits")
    what = "GPT-2 tiny [smoke]" if size == "smoke" else "GPT-3 175B"
    rows.append(Row(f"search: {what}, batch {rows_} x 2048, {gpus} A100s: {found.searched:,} plans, "
                    f"{found.fitting:,} fit; {best}", found.seconds, "s", "< 30 for >= 1,000 plans",
                    size == "smoke" or found.seconds < 30 and found.searched >= 1000))
    return rows


def local_rows(size: str) -> list[Row]:
    """Each local plan estimated twice: with ``rehearse=True`` its memory against ``describe(batch=)`` and its
    collectives' bytes against ``cfx.comm_stats`` of the real step on the local mesh (exact); without, its
    activations (Korthikanti's terms) against the rehearsal's (printed)."""
    from cfx.bench.plans import PLANS
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    x = cfx.random.randint(cfx.random.key(1), (8, 64), 0, 128)
    rows = []
    texts = {"smoke": LOCAL_PLANS[:1], "quick": LOCAL_PLANS, "full": LOCAL_PLANS + PLANS}[size]
    for text in texts:
        plan = cfx.parallel.Plan.parse(text)
        cluster = cfx.parallel.Cluster.preset("a100-80gb", plan.world_size)
        d = plan.describe(model, batch=(8, 64))
        e = cfx.parallel.estimate(model, plan, cluster, batch=(8, 64))
        exact = cfx.parallel.estimate(model, plan, cluster, batch=(8, 64), rehearse=True)
        with plan.make_mesh() as mesh:
            step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
            state, _ = step(step.init(cfx.random.key(0)), (x, x))
            with cfx.comm_stats() as stats:
                step(state, (x, x))
        memory = exact.memory == {k: v for k, v in d.bytes.items() if d.tiers[k] == "device"}
        sent = exact.collectives == stats.sent()
        total = sum(sum(by.values()) for by in exact.collectives.values())
        rows.append(Row(f"local {text}: estimate(rehearse=True) memory = describe(batch=): {memory}; collective bytes "
                        f"per axis and phase = comm_stats of the real step: {sent} ({total:,} bytes a rank)",
                        float(memory and sent), "exact", "1", memory and sent))
        state_equal = all(e.memory.get(k) == d.bytes[k] for k in ("params", "grads", "optimizer")
                          if d.tiers[k] == "device")  # (offloaded: on the host, not the GPU's)
        ratio = (e.memory["activations"] + e.memory["logits"]) / d.bytes["activations"]
        rows.append(Row(f"local {text}: estimated activations (Korthikanti's terms) / describe(batch=)'s rehearsal "
                        f"(fp32, batch 8 x 64); model state equal: {state_equal}", ratio, "x", "printed", state_equal))
    return rows


# the two hosts' link as a cluster spec would state it: tc's rate, TCP/IPv4 over Ethernet's payload share
# of what tc meters (1448 of 1514 bytes a frame), and a latency per ring step (veth + gloo: 0.1 ms)
TWOHOST_RATE, TWOHOST_LATENCY, TCP_PAYLOAD = "1gbit", 1e-4, 1448 / 1514


def twohost_rows(size: str) -> list[Row]:
    """Collectives between two network-namespace hosts (``twohost``) against ``collective_s`` for that link
    (gloo's algorithms: its reduce-scatter is an all-reduce)."""
    from cfx._src.estimate.estimate import collective_s
    from cfx.bench import twohost
    why = twohost.available()
    target = "0.85-1.15"
    if why is not None:
        return [Row("two-host collectives vs estimate", 0.0, f"skipped: {why}", target, False)]
    sizes = {"smoke": "1048576", "quick": "8388608", "full": "1048576,8388608,33554432"}[size]
    with twohost.Hosts(rate=TWOHOST_RATE) as hosts:
        out = hosts.run(["-m", "cfx.bench.twohost_worker", "--sizes", sizes, "--reps", "3" if size == "smoke" else "5",
                         "--steps", "0"])
    bw, latency = 125e6 * TCP_PAYLOAD, TWOHOST_LATENCY
    rows = []
    for r in out["collectives"]:
        est = collective_s(r["op"], 2, r["bytes"], latency, bw, backend="gloo")
        ratio = r["seconds"] / est
        rows.append(Row(f"two hosts ({TWOHOST_RATE} veth, tbf; gloo): {r['op']} of "
                        f"{r['bytes'] / 2**20:g} MiB measured {r['seconds'] * 1e3:.2f} ms / estimate {est * 1e3:.2f} ms",
                        ratio, "x", target, size == "smoke" or 0.85 <= ratio <= 1.15))
    return rows


TIMED_PLANS = ("data=8", "data=8 zero=1", "data=8 zero=3", "data=4,model=2", "data=2,model=4 zero=1",
               "pipe=2,data=4 microbatches=4", "pipe=2,data=2,model=2 zero=1 remat=blocks microbatches=2",
               "pipe=2,data=2,model=2 zero=3 microbatches=2", "pipe=2,data=4 zero=2 schedule=interleaved microbatches=2",
               "data=2,model=4 remat=blocks")


def local_time_rows(size: str) -> list[Row]:
    """Predicted against measured step time of 10 plans on 8 local ranks (this machine as a cluster:
    ``Cluster.cpu`` of ``cfx.autoshard.calibrate``'s cost model on the same mesh): Spearman's rank
    correlation, the plans as ``python -m cfx.bench plans --quick`` times them; each estimate rehearsed (the
    step's own collective calls timed: ZeRO's per-layer gathers, the embedding's and the loss's)."""
    from scipy.stats import spearmanr

    from cfx.bench import plans as plans_bench
    model, batch, seq, steps = plans_bench._setup("quick")
    with cfx.Mesh({"data": 8}) as mesh:
        cost = cfx.autoshard.calibrate(mesh, repeats=3)
    cluster = cfx.parallel.Cluster.cpu(cost, gpus=8)
    rows, predicted, measured = [], [], []
    for text in TIMED_PLANS if size == "full" else TIMED_PLANS[:5]:
        m = plans_bench.measure(text, model, batch, seq, steps)
        e = cfx.parallel.estimate(model, cfx.parallel.Plan.parse(text), cluster, batch=(batch, seq), rehearse=True)
        predicted.append(e.step_s)
        measured.append(m["step_s"])
        rows.append(Row(f"local {text}: measured {m['step_s'] * 1e3:.1f} ms / estimated {e.step_s * 1e3:.1f} ms "
                        f"(cpu preset, GPT-2 tiny, {batch} x {seq})", m["step_s"] / e.step_s, "x", "printed"))
    rho = float(spearmanr(predicted, measured).statistic)
    rows.append(Row(f"local: rank correlation of predicted and measured step times over {len(measured)} plans", rho,
                    "Spearman", ">= 0.8", rho >= 0.8))
    return rows


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    rows = published_rows(size) + fig1_rows(size) + h200_rows(size) + speed_rows(size) + local_rows(size)
    if not smoke:  # the smoke form runs in test_bench_twohost, with its training check
        rows += twohost_rows(size) + local_time_rows(size)
    return report("estimate", rows, json_path)
