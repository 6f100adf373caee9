"""Sharded state, measured: what a process holds and what crosses the wire per training step.

Four gloo processes under ``torchrun`` (the ``dist`` backend; also the ``local`` backend's rank
threads), GPT-2, AdamW, params and optimizer state as ShardedArrays across donated steps:

* ZeRO-3 over ``data``: the most ``cfx.memory`` books at once until the gradients exist
  (params + optimizer state + gradients as they arrive + gathered layers) against
  ``16 Psi / N`` plus the layers gathered together (the root's embeddings and one block), and the
  params + grads + optimizer state once the gradients exist against ``16 Psi / N``;
* peak RSS growth of each process over the steps (VmHWM, from after a warm-up) against that
  figure plus one forward's activations, and plain data parallelism's against ``16 Psi`` plus
  activations. The workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that glibc returns
  freed blocks and RSS shows live memory rather than what the allocator keeps for reuse;
* bytes each process writes to its sockets (``/proc/self/io`` wchar: gloo's TCP transport
  writes every byte it sends) over a few steps of DP, DP x TP and ZeRO-3, minus the same
  collectives replayed alone (ops, groups, sizes from ``cfx.comm_stats``): the traffic outside the
  counted collectives, to the byte; a control run that ships each step's params with
  ``all_gather_object`` (what the ``dist`` backend did before ShardedArrays) shows the measurement
  sees such traffic;
* the counted collectives per step against their textbook totals (ring algorithms): DP
  ``2 Psi (N-1)/N``, ZeRO-3 ``(3 Psi - root) (N-1)/N`` (padded pieces; the root is not
  gathered again in backward), DP x TP Megatron's
  ``4 L + 2`` all-reduces of ``b s h`` and 3 of ``b s`` over ``model`` plus the
  tensor-parallel shard's gradient all-reduce over ``data``.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import cfx
from cfx._src.parallel.megatron import MEGATRON_RULES
from cfx._src.zero.flat import piece_size
from cfx.bench.common import Row, report, size_of
from cfx.bench.memory_worker import N, config
from cfx.bench.zero import root_elements

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RSS_SLACK = 8 << 20  # per process: gloo's buffers, the allocator's slack, the logits' softmax
SENT = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n}


def _launch(args: list[str], out_dir: str, *, local: bool) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = ["-m", "cfx.bench.memory_worker", *args[:2], out_dir, *args[2:]]
    cmd = [sys.executable, *worker, "--local"] if local else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(N), *worker]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    kind, strategy = args[:2]
    files = sorted(glob.glob(os.path.join(out_dir, f"{kind}-{strategy}-{'local' if local else 'dist'}-*.json")))
    return [_read_json(f) for f in files]


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _state_rows(runs: list[list[dict]], label: str, *, rss: bool) -> tuple[list[Row], dict]:
    per = [r[0] for r in runs]
    first = per[0]
    psi, n = first["psi"], first["n"]
    gathered = first["root_bytes"] + first["block_bytes"]
    rows, out = [], {}
    if first["strategy"] == "zero3":
        peaks = [p for r in per for p, _ in r["tracked_peak"].values()]
        held = [h for r in per for _, h in r["tracked_peak"].values()]
        formula = 16 * psi / n + gathered
        worst = max(peaks) / formula
        name = "zero3_state_bytes_vs_formula" + ("_local" if "local" in label else "")
        rows.append(Row(name, worst, "x", "<= 1.05", worst <= 1.05))
        ratio = max(held) / (16 * psi / n)  # the pieces' padding is at most N-1 elements per leaf
        rows.append(Row(f"ZeRO-3 params + grads + AdamW state once grads exist / 16 Psi/N{label}", ratio, "x",
                        "1 +- 0.01", abs(ratio - 1) <= 0.01))
        out["bound"] = 16 * psi / n + gathered + first["activations"]
    else:
        out["bound"] = 16 * psi + first["activations"]
    if rss:
        growth = max(r["rss_growth"] for r in per)
        out["rss"] = growth
        what = "16 Psi/N + root + block + activations" if first["strategy"] == "zero3" else "16 Psi + activations"
        allowed = 1.1 * out["bound"] + RSS_SLACK
        rows.append(Row(f"{first['strategy']}: peak RSS growth per process / ({what}){label}", growth / out["bound"],
                        "x", f"<= 1.1 + {RSS_SLACK >> 20} MiB ({allowed / out['bound']:.2f})", growth <= allowed))
        rows.append(Row(f"{first['strategy']}: peak RSS growth per process{label}", growth / 2**20, "MiB"))
    return rows, out


def _textbook(name: str, cfg: dict, psi: int, records: list, steps: int) -> tuple[float, float]:
    """(counted bytes sent per rank and step, textbook) with ring algorithms."""
    got = 0.0
    for op, axes, numel, nbytes in records:
        n = 2 if name == "tp" and len(axes) == 1 else N
        got += nbytes * SENT[op](n)
    got /= steps
    m = cfg["model"]
    L, h, T, B = m["n_layer"], m["n_embd"], m["n_positions"], cfg["batch"]
    if name == "dp":
        return got, 4 * (psi + 1) * SENT["all_reduce"](N)
    if name == "zero3":
        model = cfx.models.gpt2("tiny", **m)
        shapes = cfx.eval_shape(model.init, cfx.random.key(0))
        padded = sum(piece_size(x.numel(), N) * N for x in cfx.tree.leaves(shapes))
        three = 3 * padded - root_elements(shapes, N)  # the root is not gathered again in backward
        return got, 4 * three * (N - 1) / N + 4 * 4 * SENT["all_reduce"](N)  # + ghost norm, loss
    model = cfx.models.gpt2("tiny", **m)
    with cfx.Mesh({"model": 2}) as mesh:
        specs = cfx.Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    local = sum(x.numel() // (2 if any(s.all_axes()) else 1)
                for x, s in zip(cfx.tree.leaves(shapes), cfx.tree.leaves(specs, is_leaf=lambda s: isinstance(s, cfx.P))))
    b = B // 2
    over_model = (4 * L + 2) * b * T * h + 3 * b * T + 1  # Megatron blocks + vocab-parallel embed/CE + norm
    over_data = local + 1                                  # the TP shard's gradients + the loss
    return got, 4 * (over_model + over_data) * SENT["all_reduce"](2)


def _traffic_rows(runs: list[list[dict]], cfg: dict, label: str) -> tuple[list[Row], float, bool]:
    """Per strategy: bytes written outside the counted collectives (worst process), and the
    counted collectives against their textbook totals (rank 0)."""
    rows, worst, all_ok = [], 0.0, True
    for i, r in enumerate(runs[0]):
        steps = r["steps"]
        outside = [(p[i]["written_step_bytes"] - p[i]["written_replay_bytes"][0]) / steps for p in runs]
        spread = max(abs(p[i]["written_replay_bytes"][0] - p[i]["written_replay_bytes"][1]) for p in runs) / steps
        out = max(outside, key=abs)
        if r["strategy"].endswith("+control"):
            rows.append(Row(f"control: DP + all_gather_object of each step's params (the old dist backend): "
                            f"bytes/step/process outside counted collectives{label}", out, "B", "> 0: seen",
                            out > spread))
            continue
        ok = abs(out) <= spread
        all_ok &= ok
        worst = max(worst, abs(out))
        rows.append(Row(f"{r['strategy']}: bytes/step/process written outside counted collectives{label}", out, "B",
                        f"0 (replays differ by {spread:,.0f})", ok))
        got, want = _textbook(r["strategy"], cfg, r["psi"], r["records"], steps)
        rows.append(Row(f"{r['strategy']}: counted bytes sent/rank/step / textbook{label}", got / want, "x",
                        "1 +- 0.01", abs(got / want - 1) <= 0.01))
    return rows, worst, all_ok


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    cfg = config(quick, smoke=smoke)
    flag = [] if size == "full" else [f"--{size}"]
    # smoke: the workers' ranks as threads of one process; torchrun's four interpreters take ~10 s a launch
    local = size == "smoke"
    where = " (local)" if local else " (torchrun)"
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model = cfx.models.gpt2("tiny", **cfg["model"])
        psi = cfx.tree.size(cfx.eval_shape(model.init, cfx.random.key(0)))
        rows.append(Row(f"GPT-2 {cfg['model']['n_layer']}x{cfg['model']['n_embd']}, vocab "
                        f"{cfg['model']['vocab_size']}, N={N}: Psi", psi, "params"))
        runs = _launch(["state", "all", *flag], d, local=local)  # per process: [zero3, dp]
        z, zo = _state_rows([[r[0]] for r in runs], where, rss=True)
        p, po = _state_rows([[r[1]] for r in runs], where, rss=True)
        rows += z + p
        rows.append(Row(f"ZeRO-3 / data parallel: peak RSS growth per process{where}", zo["rss"] / po["rss"], "x",
                        f"~ {zo['bound'] / po['bound']:.2f} (the bounds' ratio)",
                        abs(zo["rss"] / po["rss"] - zo["bound"] / po["bound"]) <= 0.1))
        if size == "full":
            z_local, _ = _state_rows(_launch(["state", "zero3"], d, local=True), " (local)", rss=False)
            rows += z_local
        t_rows, worst, ok = _traffic_rows(_launch(["traffic", "all", *flag], d, local=local), cfg, where)
        tl_rows, worst_l, ok_l = [], 0.0, True
        if not local:  # the local backend too
            tl_rows, worst_l, ok_l = _traffic_rows(_launch(["traffic", "all" if size == "full" else "dp", *flag], d,
                                                           local=True), cfg, " (local)")
    rows += t_rows + tl_rows
    rows.append(Row("dp_tp_zero3_bytes_outside_collectives", max(worst, worst_l), "B/step",
                    "0 (within the replay spread)", ok and ok_l))
    return report("memory", rows, json_path)
