"""``python -m cfx.bench autoshard``: the auto-parallel search's solver and its cost model.

* ``ilp_vs_bruteforce``: on seeded random problems shaped like a 2x2 mesh's (up to 8 ops, 2-16
  strategies each, random costs and bytes, a random DAG of edges with random resharding matrices --
  some entries 1e9, the price ``search`` puts on impossible moves -- and in half of them a memory
  budget, down to one nothing meets), the worst ratio of ``ilp.solve``'s objective to
  ``ilp.brute_force``'s (target 1, to 1e-9); the two must also refuse exactly the same problems,
  and the ILP's choice must keep the budget. Brute force stays under 20,000 assignments a problem.
* ``latency_us_<axis>``, ``bandwidth_GBps_<axis>``, ``flops_per_s_rank``: the cost model
  ``calibrate`` measures on a ``{"data": 2, "model": 2}`` mesh (informative).

* ``rank_correlation``: GPT-2 (2 layers of 128, batch 16 x 64) on a local data=2,model=2 mesh under
  the calibrated cost model: seven plans (data parallel, Megatron over either axis, every weight
  split by rows or columns over both axes or by rows over one and columns over the other, and the
  searched one; each pins the weights and the search lays out the rest), each plan's estimate
  against its lowered step's measured time (median of interleaved rounds); Spearman's rho, target
  >= 0.8.
* ``solve_s_gpt2_12l_8ranks``: trace + build + coarsen + solve of GPT-2 small's 12 layers (vocabulary
  50304, batch 8 x 128) on data=2,model=4 (and data=4,model=2 in the full run), target < 30 s.

Each entry of ``ROWS`` makes some rows from the size (``"smoke"``, ``"quick"`` or ``"full"``); a
new figure is one more function there.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

import cfx
from cfx._src.autoshard.calibrate import calibrate
from cfx._src.autoshard.ilp import NoPlanFits, Problem, brute_force, solve
from cfx.bench.common import Row, report, size_of

MAX_ASSIGNMENTS = 20_000  # brute force tries every one: under ~0.5 s a problem in Python


def random_problem(rng: np.random.Generator) -> Problem:
    """One problem of the kind the module doc describes."""
    n = int(rng.integers(1, 9))
    sizes, room = [], MAX_ASSIGNMENTS
    for left in reversed(range(n)):  # leave every later node room for 2 strategies
        s = int(rng.integers(2, min(16, room // 2 ** left) + 1))
        sizes.append(s)
        room //= s
    rng.shuffle(sizes)
    whole = rng.random() < 0.5  # integer figures: ties, several optima of one objective
    costs = [rng.integers(1, 20, s).astype(float) if whole else rng.uniform(0.1, 20, s) for s in sizes]
    memory = [rng.integers(1, 10, s).astype(float) for s in sizes]
    impossible = 0.1 if rng.random() < 0.3 else 0.0
    edges = []
    for v in range(n):
        for u in range(v):
            if rng.random() < 0.4:
                R = rng.integers(0, 15, (sizes[u], sizes[v])).astype(float) if whole else \
                    rng.uniform(0, 15, (sizes[u], sizes[v]))
                if sizes[u] == sizes[v]:
                    np.fill_diagonal(R, 0.0)  # the same layout on both sides: nothing moves
                R[rng.random(R.shape) < impossible] = 1e9
                edges.append((u, v, R))
    least, most = sum(m.min() for m in memory), sum(m.max() for m in memory)
    budget = math.inf if rng.random() < 0.5 else float(rng.choice([most, (least + most) / 2, least, least - 1]))
    return Problem.make(costs, memory, edges, budget)


def compare(problems: int, seed: int = 0) -> dict:
    """``solve`` against ``brute_force`` on ``problems`` random problems."""
    rng = np.random.default_rng(seed)
    worst, refused, disagree, over_budget = 1.0, 0, 0, 0
    for _ in range(problems):
        p = random_problem(rng)
        try:
            want = brute_force(p)
        except NoPlanFits:
            want = None
        try:
            got = solve(p)
        except NoPlanFits:
            got = None
        if want is None or got is None:
            refused += want is None and got is None
            disagree += (want is None) != (got is None)
            continue
        over_budget += got.memory > p.budget + 1e-9
        ratio = got.objective / want.objective
        worst = max(worst, ratio, 1 / ratio)  # the ILP beating brute force would be as wrong
    return {"worst": worst, "refused": refused, "disagree": disagree, "over_budget": over_budget}


def ilp_vs_bruteforce(size: str) -> list[Row]:
    n = {"smoke": 10, "quick": 120, "full": 1000}[size]
    r = compare(n)
    ok = r["worst"] <= 1 + 1e-9 and r["disagree"] == 0 and r["over_budget"] == 0
    return [
        Row("ilp_vs_bruteforce", r["worst"], "x", "1.00", ok),
        Row(f"  problems refused by both (of {n}; refused by one only: {r['disagree']})", r["refused"], "count",
            "same as brute force", r["disagree"] == 0),
        Row("  ILP choices over their budget", r["over_budget"], "count", "0", r["over_budget"] == 0),
    ]


def calibration(size: str) -> list[Row]:
    del size  # a few seconds either way
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        model = calibrate(mesh)
    rows = []
    for axis in mesh.axis_names:
        rows.append(Row(f"latency_us_{axis}", model.latency[axis] * 1e6, "us", "-"))
        rows.append(Row(f"bandwidth_GBps_{axis}", model.bandwidth[axis] / 1e9, "GB/s", "-"))
    rows.append(Row("flops_per_s_rank", model.flops_per_s, "FLOP/s", "-"))
    return rows


def _weights(params, spec_of) -> dict:
    """A plan's param specs by path: ``spec_of(shape)`` for matrices, whole for the rest."""
    return {path: (spec_of(tuple(x.shape)) if x.dim() == 2 else cfx.P())
            for path, x in cfx.tree.flatten_with_path(params)[0]}


def plans(model, params, mesh) -> dict[str, dict | None]:
    """Hand plans of different speeds, each pinning the params' specs (the search lays out the
    activations around them), and the free search (``None``)."""
    from cfx._src.autoshard.train import megatron_reference
    megatron = megatron_reference(model, mesh)
    swap = {"data": "model", "model": "data"}
    return {
        "data parallel": _weights(params, lambda s: cfx.P()),
        "Megatron over model": megatron,
        "Megatron over data": {k: cfx.P(*(swap.get(a, a) if isinstance(a, str) else a for a in v))
                               for k, v in megatron.items()},
        "rows over both axes": _weights(params, lambda s: cfx.P(("data", "model"))),
        "columns over both axes": _weights(params, lambda s: cfx.P(None, ("data", "model"))),
        "rows over model, columns over data": _weights(params, lambda s: cfx.P("model", "data")),
        "searched": None,
    }


def estimated_and_measured(*, size: str) -> list[tuple[str, float, float]]:
    """``(plan, estimated s, measured s)`` for GPT-2 on a local data=2,model=2 mesh under the
    calibrated cost model: each plan's lowered step timed (median of rounds, interleaved)."""
    from cfx._src.autoshard.graph import trace
    from cfx._src.autoshard.lower import lower
    from cfx._src.autoshard.search import search
    from cfx.bench.common import interleaved_medians
    layers, width, rows, seq = (1, 32, 4, 16) if size == "smoke" else (2, 128, 16, 64)
    model = cfx.models.gpt2("tiny", n_layer=layers, vocab_size=256, n_positions=seq, n_embd=width, n_head=4)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (rows, seq + 1), 0, 256)
    batch = (tokens[:, :-1], tokens[:, 1:])
    graph = trace(model.loss, params, *batch)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        cost = calibrate(mesh)
        rows, runs = [], []
        for name, fixed in plans(model, params, mesh).items():
            solved = search(graph, dict(mesh.shape), cost=cost, fixed=fixed)
            step = lower(graph, solved.choices, mesh, param_tree=params, batch_tree=batch)
            placed = cfx.tree.map(lambda x, s: cfx.device_put(x, mesh, s), params, step.param_specs)
            rows.append((name, solved.solution.objective))
            runs.append(lambda step=step, placed=placed: cfx.device_get(step(placed, *batch)[0]))
        times = interleaved_medians(runs, rounds={"smoke": 1, "quick": 3, "full": 7}[size],
                                    warmup=0 if size == "smoke" else 1)
    return [(name, est, t) for (name, est), t in zip(rows, times)]


def rank_correlation(size: str) -> list[Row]:
    from scipy.stats import spearmanr
    got = estimated_and_measured(size=size)
    rho = float(spearmanr([e for _, e, _ in got], [m for _, _, m in got]).statistic)
    rows = [Row(f"rank_correlation ({len(got)} plans, GPT-2 on data=2,model=2)", rho, "spearman", ">= 0.8",
                rho >= 0.8)]
    rows += [Row(f"  {name}: estimated / measured ms", round(e * 1e3, 2), f"/ {m * 1e3:.1f} ms", "-")
             for name, e, m in got]
    return rows


def gpt2_search_seconds(mesh_shape: dict[str, int], *, n_layer: int = 12, batch: int = 8, seq: int = 128,
                        coarsen: bool = True) -> tuple[float, dict]:
    """Trace + build + solve of GPT-2 small's shapes (768 wide, 12 heads, a 50304 vocabulary) on a
    mesh of ``mesh_shape``: wall seconds, and the parts."""
    import time
    from cfx._src.autoshard.graph import trace
    from cfx._src.autoshard.search import search
    t0 = time.perf_counter()
    model = cfx.models.gpt2("small", n_layer=n_layer, vocab_size=50304)
    params = cfx.eval_shape(model.init, cfx.random.key(0))  # shapes only: traced on fake tensors
    tokens = cfx.ShapeDtype((batch, seq), torch.int64)
    graph = trace(model.loss, params, tokens, tokens)
    t1 = time.perf_counter()
    solved = search(graph, mesh_shape, coarsen=coarsen)
    t2 = time.perf_counter()
    return t2 - t0, {"trace": t1 - t0, "search": t2 - t1, "ops": len(graph.ops), "objective": solved.solution.objective}


def solve_seconds(size: str) -> list[Row]:
    rows = []
    n_layer = 1 if size == "smoke" else 12
    for mesh in ({"data": 2, "model": 4},) if size != "full" else ({"data": 2, "model": 4}, {"data": 4, "model": 2}):
        total, parts = gpt2_search_seconds(mesh, n_layer=n_layer)
        name = f"solve_s_gpt2_{n_layer}l_8ranks" + ("" if mesh == {"data": 2, "model": 4} else "_data4_model2")
        rows.append(Row(name, round(total, 2), "s", "< 30", total < 30))
        rows.append(Row(f"  {parts['ops']} ops: trace / search", round(parts["trace"], 2),
                        f"/ {parts['search']:.2f} s", "-"))
    return rows


ROWS: list[Callable[[str], list[Row]]] = [ilp_vs_bruteforce, calibration, rank_correlation, solve_seconds]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    return report("autoshard", [row for make in ROWS for row in make(size)], json_path)
