"""Sequence parallelism's memory: activation bytes per rank, and the longest sequence a budget trains.

A GPT-2 (fp32, 2 layers, width 64, 4 heads, byte vocabulary) runs one forward + backward per
measurement inside ``shard_map`` on 4 local ranks; ``cfx.memory.track(ops=True)`` books every op
output and saved tensor of each rank, and the figure is the largest rank's peak (gradients in
flight included). The methods, each as cfx runs it by default:

* ``tp``: Megatron tensor parallelism over ``{"model": 4}`` (vocabulary-parallel head), the
  baseline: norms, residuals and the blocks' inputs stay whole on every rank;
* ``ring`` / ``ulysses`` over ``{"seq": 4}``, ``hybrid`` over ``{"ring": 2, "seq": 2}``,
  ``megatron`` (``tensor_parallel(sequence=True)``) over ``{"model": 4}``.

Rows: ``<method>_activations_per_token_vs_1/N``: the activation bytes each extra token costs a
rank (the slope between two lengths, so the params' gradients, a constant, drop out) times N,
over the slope of one device: 1.00 when every activation is split N ways (target within 15%).
``<method>_max_seq_vs_tp``: the longest sequence (a multiple of 8) whose step fits the per-rank
budget, over TP's under the same budget; the budget is what TP's step takes at ``T_tp`` (so TP's
longest is about ``T_tp``), and every longest length is checked by a run at it and one 8 longer.
Attention on CPU keeps O(T) memory on both sides (SDPA's flash kernel for TP and Ulysses, the
ring's blocks a query tile at a time), so TP loses only what it keeps whole; the anchor of 3.0
(Li et al., 2021) came against TP holding full (T, T) score matrices, which the context row
``ring_max_seq_vs_tp_with_materialized_scores`` measures (TP on the reference attention).
"""
from __future__ import annotations

import dataclasses
import math

import cfx
from cfx import P
from cfx.bench.common import Row

N, GRAIN, WIDTH, HEADS, LAYERS, VOCAB = 4, 8, 64, 4, 2, 256
SP_METHODS = ("ring", "ulysses", "hybrid", "megatron")
MESHES = {"tp": {"model": N}, "megatron": {"model": N}, "ring": {"seq": N}, "ulysses": {"seq": N},
          "hybrid": {"ring": 2, "seq": 2}, "one": {"seq": 1}}


def activation_peak(method: str, T: int, *, B: int = 1, impl: str = "auto") -> int:
    """The largest rank's peak activation bytes for one forward + backward at length ``T``."""
    model = cfx.models.gpt2("tiny", n_layer=LAYERS, vocab_size=VOCAB, n_positions=T, n_embd=WIDTH, n_head=HEADS)
    if impl != "auto":
        model = model.map_blocks(lambda b: dataclasses.replace(b, attn_impl=impl))
    rules = dict(cfx.parallel.MEGATRON_RULES)
    if method == "tp":
        net, spec = cfx.parallel.tensor_parallel(model, "model"), P()
    elif method == "megatron":
        rules.pop("vocab")
        net, spec = cfx.parallel.tensor_parallel(model, "model", sequence=True), P(None, "model")
    elif method == "hybrid":
        net, spec = cfx.parallel.sequence_parallel(model, ("ring", "seq"), method="hybrid"), P(None, ("ring", "seq"))
    else:  # ring, ulysses, and "one": the unsplit model on one rank
        net = cfx.parallel.sequence_parallel(model, "seq", method="ulysses" if method == "one" else method)
        spec = P(None, "seq")
    tokens = cfx.random.randint(cfx.random.key(1), (B, T + 1), 0, VOCAB)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if method in ("ring", "hybrid"):  # zigzag order over the ring's ranks
        order = net.sublayers()["sequence"].order(T, MESHES[method].get("ring", N) if method == "hybrid" else N)
        x, y = x[:, order], y[:, order]
    shape = MESHES[method]
    with cfx.Mesh(shape) as mesh:
        specs = cfx.Rules(rules).specs(model.axes(), mesh=mesh) if "model" in shape else P()
        step = cfx.shard_map(lambda p, x, y: cfx.value_and_grad(net.loss)(p, x, y)[0], mesh=mesh,
                             in_specs=(specs, spec, spec), out_specs=P())
        params = model.init(cfx.random.key(0))
        with cfx.memory.track(ops=True) as mem:
            step(params, x, y)
    return max(mem.peak_by_kind("device", rank=r).get("activation", 0) for r in range(mesh.size))


def per_token(method: str, T: int) -> float:
    """Activation bytes per extra token of the whole sequence, on the largest rank."""
    return (activation_peak(method, 2 * T) - activation_peak(method, T)) / T


def longest(method: str, budget: int, guess: int, *, impl: str = "auto") -> int:
    """The longest multiple of ``GRAIN`` whose step peaks within ``budget``: a line through two
    measured lengths, then runs at the answer and one grain longer (stepping until both agree)."""
    lo, hi = guess // 2, guess
    a, b = activation_peak(method, lo, impl=impl), activation_peak(method, hi, impl=impl)
    slope = max((b - a) / (hi - lo), 1.0)
    T = max(GRAIN, int((budget - a) / slope + lo) // GRAIN * GRAIN)
    while activation_peak(method, T, impl=impl) > budget and T > GRAIN:
        T -= GRAIN
    while activation_peak(method, T + GRAIN, impl=impl) <= budget:
        T += GRAIN
    return T


def rows(*, size: str = "full") -> list[Row]:
    """The module doc's rows; ``size="smoke"`` measures the ring alone against TP (each method is one
    more run of the same code, and every measurement here is a whole step on 4 ranks)."""
    out = []
    # smoke: shorter lengths would measure the params' gradients more than the activations
    T, T_tp = {"smoke": (64, 256), "quick": (256, 1024), "full": (512, 2048)}[size]
    methods = SP_METHODS[:1] if size == "smoke" else SP_METHODS
    one = per_token("one", T)
    for method in (*methods, "tp"):
        ratio = per_token(method, T) * N / one
        ok = abs(ratio - 1.0) <= 0.15 if method != "tp" else True
        out.append(Row(f"{method}_activations_per_token_vs_1/N ({MESHES[method]}, T={T}..{2 * T})", ratio, "x",
                       "1.00 +-15%" if method != "tp" else "", ok))
    budget = activation_peak("tp", T_tp)
    tp = longest("tp", budget, T_tp)
    out.append(Row(f"  per-rank activation budget (TP's step at T={T_tp})", budget / 2**20, "MiB"))
    out.append(Row("  tp longest sequence under the budget", tp, "tokens"))
    for method in methods:
        got = longest(method, budget, 2 * T_tp)
        out.append(Row(f"{method}_max_seq_vs_tp ({got} vs {tp} tokens, 4 ranks)", got / tp, "x", ">= 3.0",
                       got / tp >= 3.0))
    # context: TP on the reference attention, which holds (B, H/N, T, T) scores -- the 2021 baseline
    tp_scores = longest("tp", budget, T_tp // 2, impl="reference")
    ring = next(r for r in out if r.metric.startswith("ring_max_seq_vs_tp")).value * tp
    out.append(Row(f"  ring_max_seq_vs_tp_with_materialized_scores ({int(ring)} vs {tp_scores} tokens)",
                   ring / tp_scores, "x"))
    assert math.isfinite(out[-1].value)
    return out
