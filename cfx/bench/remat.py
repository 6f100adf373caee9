"""``python -m cfx.bench remat``: activation memory vs recompute for GPT-2 small on CPU.

For budgets from the no-remat peak down to the minimum feasible one, the Rotor solver's schedule
is run for real: its measured peak activation bytes (the distinct storages the chain holds, see
``cfx/_src/remat/execute.py``), its forward+backward time, and its recomputed FLOPs. Chen's
sqrt(n) segmentation and full-block checkpointing (every block's input kept, each block
recomputed once) run on the same executor as baselines. Anchors: Chen et al. report about +30%
runtime for sqrt(n) memory; Korthikanti et al.'s selective recompute costs +2.7% FLOPs.

A ``budget`` row is ok when the measured peak is <= the budget and, where Chen's schedule fits the
same budget, the solver recomputes no more than Chen.
"""
from __future__ import annotations

import torch

import cfx
from cfx._src.remat import solver
from cfx.bench.common import Row, interleaved_medians, report, size_of


def _mib(n: float) -> float:
    return round(n / 2**20, 2)


def _setup(size: str):
    if size == "smoke":
        model = cfx.models.gpt2("tiny", n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        B, T = 1, 16
    elif size == "quick":
        model = cfx.models.gpt2("tiny", n_layer=6, n_embd=128, n_head=4, vocab_size=512)
        B, T = 4, 128
    else:
        model = cfx.models.gpt2("small")
        B, T = 2, 256
    params = model.init(cfx.random.key(0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    return model, params, tokens, targets


def _measure(model_r, params, tokens, targets) -> int:
    with cfx.activation_stats() as stats:
        cfx.value_and_grad(model_r.loss)(params, tokens, targets)
    (_, peak), = stats.chain_peaks
    return peak


def curve(size: str) -> list[dict]:
    """One dict per configuration: name, budget, plan peak, measured peak, time, recompute."""
    model, params, tokens, targets = _setup(size)
    m_no, p_no = cfx.remat.chen(model, params, tokens, segment=10**9)  # one segment: no recompute
    m_chen, p_chen = cfx.remat.chen(model, params, tokens)
    m_full, p_full = cfx.remat.chen(model, params, tokens, segment=1)
    no_peak = p_no.peak
    lo = solver.minimum_budget(p_no.chain)
    configs = [("no remat", None, m_no, p_no), (p_chen.method, None, m_chen, p_chen),
               ("full-block checkpointing", None, m_full, p_full)]
    fracs = {"smoke": [0.5], "quick": [0.75, 0.5, 0.35], "full": [0.75, 0.5, 0.4, 0.3, 0.2]}[size]
    budgets = {int(no_peak * f) for f in fracs if no_peak * f >= lo} | {lo, p_chen.peak}
    budgets = sorted(budgets, reverse=True)  # includes Chen's own peak: the same budget, head to head
    for b in budgets:
        m_r, p_r = cfx.remat.solve(model, params, tokens, budget=b)
        configs.append((f"rotor budget {_mib(b)} MiB", b, m_r, p_r))
    fns = [lambda m=m: cfx.value_and_grad(m.loss)(params, tokens, targets) for _, _, m, _ in configs]
    times = interleaved_medians(fns, rounds={"smoke": 1, "quick": 2, "full": 3}[size])
    out = []
    for (name, budget, m, plan), t in zip(configs, times):
        out.append(dict(name=name, budget=budget, plan_peak=plan.peak,
                        measured=_measure(m, params, tokens, targets), time=t,
                        recompute=plan.recompute_fraction, recompute_flops=plan.recompute_flops))
    return out, p_chen


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    points, p_chen = curve(size_of(quick=quick, smoke=smoke))
    base = points[0]
    rows = []
    for pt in points:
        name, t_ratio = pt["name"], pt["time"] / base["time"]
        if pt["budget"] is None:
            rows.append(Row(f"{name}: peak activations", _mib(pt["measured"]), "MiB", "info"))
        else:
            chen_fits = p_chen.peak <= pt["budget"]
            ok = pt["measured"] <= pt["budget"] and (not chen_fits or pt["recompute_flops"] <= p_chen.recompute_flops)
            rows.append(Row(f"{name}: measured peak", _mib(pt["measured"]), "MiB",
                            "<= budget" + (", recompute <= chen" if chen_fits else ""), ok))
        rows.append(Row(f"{name}: recomputed FLOPs", round(100 * pt["recompute"], 1), "% of fwd+bwd", "info"))
        if pt is base:
            rows.append(Row(f"{name}: fwd+bwd time", round(pt["time"], 3), "s", "info"))
        else:
            rows.append(Row(f"{name}: fwd+bwd time", round(t_ratio, 3), "x no remat", "info"))
    half = [p for p in points if p["budget"] is not None and p["budget"] <= 0.5 * base["measured"]]
    if half:
        h = half[0]
        rows.append(Row("rotor at half the no-remat memory: runtime overhead",
                        round(100 * (h["time"] / base["time"] - 1), 1), "%", "Chen ~+30% (anchor)"))
        rows.append(Row("rotor at half the no-remat memory: recomputed FLOPs",
                        round(100 * h["recompute"], 1), "%", "selective +2.7% (anchor)"))
    return report("remat", rows, json_path)
