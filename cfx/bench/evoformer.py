"""The Evoformer at length: AutoChunk's memory and speed, DAP's bytes and memory per rank.

One Evoformer block at AlphaFold's head counts with narrower channels (``c_m = c_z = 32``, 4 pair
heads; ``CONFIG``) and 8 sequences, fp32, inference. Peak activation bytes are measured with
``cfx.memory`` (every op's fresh outputs, inputs and params excluded); lengths whose unchunked
estimate exceeds ``MEASURE_LIMIT`` are reported from the estimate (the traced graph's liveness,
which the measured lengths check).

* ``autochunk_memory_reduction``: unchunked peak over AutoChunk's at the longest length both run,
  AutoChunk under the fixed budget (target >= 4.0, FastFold's "75% less memory");
* the longest length each fits in that budget (unchunked: its estimate; AutoChunk: a plan found);
* ``autochunk_slowdown``: AutoChunk's time over unchunked at a length where its regions are
  active (target <= 1.10);
* ``dap_bytes_vs_formula``: what one rank sends per block on ``{"axial": 4}``, over
  ``cfx.parallel.dap``'s formula (1.00);
* ``dap_memory_vs_1_over_n``: the largest rank's peak on ``{"axial": 4}`` times 4 over one
  device's (target <= 1.10; the gathered biases and triangle operands are whole on every rank).
"""
from __future__ import annotations

import time

import torch

import cfx
from cfx import P
from cfx._src.models.evoformer_dap import comm_bytes
from cfx._src.core.text import format_bytes
from cfx.bench.common import Row, interleaved_medians, report, size_of

CONFIG = dict(n_blocks=1, c_m=32, c_z=32, c_hidden_msa_att=8, n_heads_msa=4, c_hidden_opm=8, c_hidden_mul=32,
              c_hidden_pair_att=8, n_heads_pair=4)
S = 8
MEASURE_LIMIT = 6 << 30
SIZES = {  # size -> (AutoChunk's lengths, its budget, the slowdown's length and rounds, DAP's length)
    "smoke": ([32, 64], 1 << 20, 96, 1, 16),  # 96: the shortest a quarter of the activations fits
    "quick": ([64, 128, 192, 256], 48 << 20, 192, 5, 128),
    "full": ([128, 256, 384, 512, 768, 1024], 1 << 30, 256, 5, 192),
}


def _model():
    cfg = cfx.models.EvoformerConfig(**CONFIG)
    model = cfx.models.Evoformer(cfg)
    return model, model.init(cfx.random.key(0))


def _inputs(cfg, R: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, z = torch.randn(S, R, cfg.c_m, generator=g), torch.randn(R, R, cfg.c_z, generator=g)
    return m, z, dict(msa_mask=torch.ones(S, R, dtype=torch.bool), pair_mask=torch.ones(R, R, dtype=torch.bool))


def _measured(fn, *args, **kwargs) -> tuple[int, float]:
    with cfx.memory.track() as mem, mem.track_ops(tier="host"), torch.no_grad():
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
    return mem.peak("host"), seconds


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    lengths, budget, slow_R, rounds, dap_R = SIZES[size_of(quick=quick, smoke=smoke)]
    torch.manual_seed(0)
    rows = _autochunk_rows(lengths, budget) + [_slowdown(*_model(), slow_R, rounds)] + _dap_rows(dap_R)
    return report("evoformer", rows, json_path)


def _autochunk_rows(lengths: list[int], budget: int) -> list[Row]:
    model, params = _model()
    cfg = model.config
    table, both, fits_plain, fits_chunked = [], None, 0, 0
    for R in lengths:
        m, z, masks = _inputs(cfg, R)
        args = (params, m, z)
        plain = cfx.autochunk(model.apply, args, memory_budget=1 << 50, kwargs=masks)
        estimate = plain.compile(*args, **masks).unchunked_bytes
        measured = _measured(model.apply, *args, **masks)[0] if estimate <= MEASURE_LIMIT else None
        if estimate <= budget:
            fits_plain = R
        try:
            chunked = cfx.autochunk(model.apply, args, memory_budget=budget, kwargs=masks)
        except ValueError:
            table.append((R, estimate, measured, None))
            continue
        fits_chunked = R
        peak = _measured(chunked, *args, **masks)[0]
        table.append((R, estimate, measured, peak))
        if measured is not None:
            both = (R, measured, peak)
    rows = [Row(f"  R={R}: peak unchunked ({'measured' if meas else 'estimated'}) / AutoChunk",
                (meas or est) / 2**20, "MiB", f"AutoChunk {peak / 2**20:.1f} MiB" if peak else "AutoChunk: no plan fits")
            for R, est, meas, peak in table]
    reduction = both[1] / both[2] if both else 0.0
    rows.insert(0, Row(f"autochunk_memory_reduction (R={both[0] if both else '-'}, budget {format_bytes(budget, exact=True)})",
                       reduction, "x", ">= 4.0 (75% less)", reduction >= 4.0))
    rows.append(Row("  longest length in the budget, unchunked", fits_plain, "residues"))
    rows.append(Row("  longest length in the budget, AutoChunk", fits_chunked, "residues",
                    f"> {fits_plain}", fits_chunked > fits_plain))
    return rows


def _slowdown(model, params, R: int, rounds: int) -> Row:
    m, z, masks = _inputs(model.config, R)
    args = (params, m, z)
    estimate = cfx.autochunk(model.apply, args, memory_budget=1 << 50, kwargs=masks).compile(*args, **masks)
    chunked = cfx.autochunk(model.apply, args, memory_budget=estimate.unchunked_bytes // 4, kwargs=masks)
    regions = len(chunked.compile(*args, **masks).choices)
    with torch.no_grad():
        plain_s, chunked_s = interleaved_medians([lambda: model.apply(*args, **masks), lambda: chunked(*args, **masks)],
                                                 rounds=rounds)
    ratio = chunked_s / plain_s
    return Row(f"autochunk_slowdown (R={R}, a quarter of the activations, {regions} regions)", ratio, "x",
               "<= 1.10", ratio <= 1.10)


def _dap_rows(R: int) -> list[Row]:
    model, params = _model()
    cfg = model.config
    n = 4
    m, z, _ = _inputs(cfg, R)
    dmodel = cfx.parallel.dap(model, "axial")
    single, _ = _measured(model.apply, params, m, z)
    with cfx.Mesh({"axial": n}) as mesh, cfx.comm_stats() as stats, cfx.memory.track(ops=True) as mem:
        f = cfx.shard_map(lambda p, m, z: dmodel.apply(p, m, z), mesh=mesh, in_specs=(P(), P("axial"), P("axial")),
                          out_specs=(P("axial"), P("axial")))
        with torch.no_grad():
            f(params, m, z)
        per_rank = max(mem.peak("device", rank=r) for r in range(n))
    want = comm_bytes(cfg, S, R, n)
    sent = sum(stats.bytes(op=op, axes="axial", rank=0) for op in want) / cfg.n_blocks
    ratio, mem_ratio = sent / sum(want.values()), per_rank * n / single
    return [
        Row(f"dap_bytes_vs_formula (axial={n}, S={S}, R={R}, per block)", ratio, "x", "1.00", abs(ratio - 1) < 1e-9),
        Row("  bytes per block and rank", sent / 2**20, "MiB"),
        Row(f"dap_memory_vs_1_over_n (axial={n}, R={R})", mem_ratio, "x", "<= 1.10", mem_ratio <= 1.10),
        Row("  one device", single / 2**20, "MiB"),
        Row("  the largest rank", per_rank / 2**20, "MiB"),
    ]
