"""Multi-dimensional tensor parallelism: what 1D, 2D, 2.5D and 3D send, whom they talk to and what they
hold per rank, measured against each scheme's formula (``cfx._src.parallel.tp_cost``'s module doc).

One GPT-2-style block (fp32) runs forward and backward on a local mesh, as a middle block does
(its input and output in the grid's layout; 1D: Megatron's block over ``model``). ``cfx.comm_stats``
counts every collective rank 0 issues; each becomes the bytes a ring algorithm sends
(``sequence.WIRE``) and the ranks of its group. Rows:

* ``<scheme>_bytes_vs_formula`` (target 1.00): measured bytes sent per block / the formula;
* ``<scheme>_peers_vs_formula``, ``<scheme>_param_bytes_vs_formula``,
  ``<scheme>_activation_bytes_vs_formula`` (1.00): distinct peers, the params and the block input
  each rank holds;
* ``<scheme>_step_ms`` beside ``1d_step_ms`` on as many ranks (information: threads on shared cores);
* the formulas at P = 8, 64, 1000 for a GPT-2 medium block (B=8, T=1024, C=1024):
  ``peers_per_rank_p<P>`` (Megatron's 999 against the cube's 27, 9 per collective),
  ``largest_group_p<P>``, ``comm_MB_per_rank_p<P>``, ``param_MB_per_rank_p<P>``.
"""
from __future__ import annotations

import dataclasses
import math

import torch

import cfx
from cfx import P
from cfx._src.parallel import tp_cost
from cfx.bench.common import Row, interleaved_medians, report, size_of
from cfx.bench.sequence import WIRE

GRIDS = {"1d": ({"model": 4}, {"model": 8}), "2d": ({"row": 2, "col": 2},),
         "2.5d": ({"row": 2, "col": 2, "dep": 2},), "3d": ({"row": 2, "col": 2, "dep": 2},)}
MEDIUM = tp_cost.BlockDims(B=8, T=1024, C=1024, F=4096, A=1024, Akv=1024)


def _net(scheme: str, block):
    """The block as ``scheme`` runs it, its params' specs and its input's spec."""
    if scheme == "1d":
        return (cfx.parallel.TensorParallelBlock(block, "model"), cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(
            block.axes()), P())
    net = dataclasses.replace(cfx.parallel.tensor_parallel_grid(block, scheme), enter=False, leave=False)
    return net, cfx.parallel.grid_specs(net), net.grid.a.spec()


def measure(scheme: str, shape: dict, *, B: int = 8, T: int = 8, C: int = 32, H: int = 8, rounds: int = 0,
            **block_kw) -> dict:
    """One block's forward + backward on ``shape``: rank 0's bytes sent, peers, param and input bytes,
    the formulas', and (``rounds`` > 0) the median step time. ``block_kw``: more ``TransformerBlock``
    fields (``n_kv_heads``, ``norm``, ``bias``, ``activation``)."""
    block = cfx.nn.TransformerBlock(C, H, 4 * C, **block_kw)
    dims = tp_cost.BlockDims.of(block, B, T)
    net, specs, xspec = _net(scheme, block)
    params, x = block.init(cfx.random.key(0)), torch.randn(B, T, C)
    held = {}

    def body(p, x):
        cfx.grad(lambda p, x: net.apply(p, x).sum(), argnums=(0, 1))(p, x)
        if cfx.lax.axis_index(tuple(shape)) == 0:
            held["params"] = sum(t.numel() * t.element_size() for t in cfx.tree.leaves(p))
            held["acts"] = x.numel() * x.element_size()
        return x.sum()[None]

    with cfx.Mesh(shape) as mesh:
        step = cfx.shard_map(body, mesh=mesh, in_specs=(specs, xspec), out_specs=P(tuple(shape)), check_rep=False)
        with cfx.comm_stats() as stats:
            step(params, x)
        ms = interleaved_medians([lambda: step(params, x)], rounds)[0] * 1e3 if rounds else 0.0
        recs = stats.select(rank=0)
        groups = [mesh.group_members(r.axes, 0) for r in recs]
    q = shape["model"] if scheme == "1d" else shape["row"]
    d = shape.get("dep", 1)
    return dict(wire=sum(r.nbytes * WIRE[r.op](len(g)) for r, g in zip(recs, groups)),
                peers=len(set().union(*groups) - {0}), group=max(len(g) for g in groups) - 1, ms=ms, **held,
                f_wire=tp_cost.comm_bytes(scheme, dims, q, d), f_peers=tp_cost.peers(scheme, q, d)[0],
                f_params=tp_cost.param_bytes(scheme, dims, q, d), f_acts=tp_cost.activation_bytes(scheme, dims, q, d))


def formula_table(dims: tp_cost.BlockDims = MEDIUM, Ps: tuple[int, ...] = (8, 64, 1000)) -> list[dict]:
    """Every scheme at every ``P`` from the formulas (``tp_cost.table``), for the notebook and the rows."""
    return tp_cost.table(dims, Ps)


def grid_label(r: dict) -> str:
    """``n=8``, ``q=4``, ``q=4 d=4``: a ``formula_table`` row's grid."""
    if r["scheme"] == "1d":
        return f"n={r['P']}"
    return f"q={r['q']:.3g}" + (f" d={r['d']:.3g}" if r["scheme"] == "2.5d" else "")


def _measured_rows(size: str) -> list[Row]:
    C, rounds = {"smoke": (16, 0), "quick": (64, 3), "full": (128, 10)}[size]
    rows, times = [], {}
    for scheme, shapes in GRIDS.items():
        for shape in shapes[:1] if size == "smoke" else shapes:
            m = measure(scheme, shape, C=C, T=8 if size == "smoke" else 32, rounds=rounds)
            where = " x ".join(f"{a}={n}" for a, n in shape.items())
            for key, what in (("wire", "bytes"), ("peers", "peers"), ("params", "param_bytes"),
                              ("acts", "activation_bytes")):
                ratio = m[key] / m[f"f_{key}"]
                rows.append(Row(f"{scheme}_{what}_vs_formula, {where}", ratio, "x", "1.00", abs(ratio - 1) < 1e-9))
            rows.append(Row(f"  {scheme} bytes sent per block (fwd+bwd, rank 0), {where}", m["wire"], "B"))
            rows.append(Row(f"  {scheme} peers per rank / largest group, {where}", m["peers"], f"(group {m['group']})"))
            times[(math.prod(shape.values()), scheme)] = (m["ms"], where)
    if rounds:  # side by side on as many ranks: 1D beside each grid
        rows += [Row(f"  {scheme}_step_ms, {where} ({n} ranks; information)", ms, "ms")
                 for (n, scheme), (ms, where) in sorted(times.items())]
    return rows


def _formula_rows() -> list[Row]:
    rows = []
    for r in formula_table():
        grid = grid_label(r)
        note = "" if r["exact"] else " (no integer grid: formula only)"
        tag = f"{r['scheme']}_p{r['P']}"
        target = {("1d", 1000): "999", ("3d", 1000): "27 (9 per collective)"}.get((r["scheme"], r["P"]), "")
        rows.append(Row(f"peers_per_rank_p{r['P']}, {r['scheme']} {grid}{note}", r["peers"], "ranks", target,
                        not target or r["peers"] == int(target.split()[0])))
        rows.append(Row(f"largest_group_p{r['P']}, {r['scheme']}", r["group"], "ranks"))
        rows.append(Row(f"comm_MB_per_rank, {tag} (GPT-2 medium block, fwd+bwd)", r["comm"] / 2 ** 20, "MiB"))
        rows.append(Row(f"param_MB_per_rank, {tag}", r["params"] / 2 ** 20, "MiB"))
        rows.append(Row(f"activation_MB_per_rank, {tag} (block input)", r["acts"] / 2 ** 20, "MiB"))
    return rows


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    return report("tensor_parallel", _measured_rows(size) + _formula_rows(), json_path)
