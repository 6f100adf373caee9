"""Pipeline parallelism: bubbles simulated and measured, activations held, step time vs torch.

* simulated bubble fraction of each schedule with unit costs against the textbook figure:
  GPipe / 1F1B (p-1)/(m+p-1) with F = B = 1; interleaved 1F1B (v = 2, F = B = 1 per chunk)
  (p-1)/(v*m+p-1); ZB-H1 (p-1)/(3m+p-1) with F = I = W = 1;
* measured bubble fraction (``cfx.pipeline.trace``: idle / (p * makespan), waiting in a RECV is
  idle) of real steps of a small GPT-2 on a ``local`` mesh: rank threads share this machine's
  cores, so read it as information, not as the schedule's property;
* peak activation bytes per stage (``cfx.memory``, kind "activation"): rank 0's peak in units of
  one microbatch's activations (measured by a 1-microbatch run) against the schedule's count
  of activations alive (GPipe m, 1F1B and ZB-H1 min(p, m), interleaved min(vm, (v+1)p-1)
  chunks of 1/v each; ZB-H1 counted until W, which is when this executor frees them);
* step time of ``cfx.pipeline`` against ``torch.distributed.pipelining`` (ScheduleGPipe /
  Schedule1F1B) on the same GPT-2 stages, both in the same gloo processes (one per rank, the
  cfx side on a ``dist`` mesh; each rank holding only its own blocks on both sides, cfx's
  ``local_blocks=True`` as a Plan runs it), in alternating rounds, each step started on every
  rank together and lasting as long as its slowest rank (``lockstep_medians``); rows
  ``1f1b_vs_torch_{p}stages`` (m = 8, target <= 1.00). torch's stages are nn.Modules of the
  same math (``torch_gpt2.Block``); its last stage holds an untied copy of the head weight, since
  a torch pipeline stage cannot share a parameter with another stage.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import cfx
from cfx import P
from cfx import pipeline
from cfx.bench.common import Row, end_worker, lockstep_medians, report, size_of
from cfx.bench.torch_gpt2 import TorchGPT2

V, T, C, N_LAYER, ROWS = 256, 32, 64, 8, 2  # ROWS: rows per microbatch
UNIT = {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}
NAMED_M = 8  # the microbatches of the 1f1b_vs_torch_{p}stages rows
SIZES = {  # size -> (pipe sizes, microbatch counts, rounds measured on the local mesh, rounds vs torch)
    "smoke": ((2,), (2,), 1, 1),
    "quick": ((2,), (4, 8), 3, 5),
    "full": ((2, 4), (4, 8, 16), 5, 30),
}


def schedules(p: int, m: int) -> dict:
    return {"gpipe": pipeline.gpipe(p, m), "1f1b": pipeline.one_f_one_b(p, m),
            "interleaved v=2": pipeline.interleaved_1f1b(p, m, 2), "zb_h1": pipeline.zb_h1(p, m)}


def textbook_bubble(name: str, p: int, m: int) -> float:
    work = {"gpipe": m, "1f1b": m, "interleaved v=2": 2 * m, "zb_h1": 3 * m}[name]
    return (p - 1) / (work + p - 1)


def model():
    return cfx.models.gpt2("tiny", n_layer=N_LAYER, vocab_size=V, n_embd=C, n_head=4, n_positions=T)


def batch(m: int):
    d = cfx.random.randint(cfx.random.key(1), (ROWS * m, T + 1), 0, V)
    return d[:, :-1].contiguous(), d[:, 1:].contiguous()  # (torch 2.11's stages check the strides they inferred)


def simulated_rows(grid) -> list[Row]:
    rows = []
    for p, m in grid:
        for name, sched in schedules(p, m).items():
            got, want = pipeline.simulate(sched, cost=UNIT).bubble_fraction, textbook_bubble(name, p, m)
            rows.append(Row(f"simulated bubble, {name}, p={p} m={m} (unit costs)", got, "fraction",
                            f"= {want:.4f}", abs(got - want) < 1e-9))
    return rows


def measured_rows(grid, rounds: int) -> list[Row]:
    rows, mdl = [], model()
    params = mdl.init(cfx.random.key(0))
    for p in sorted({p for p, _ in grid}):
        with cfx.Mesh({"pipe": p}) as mesh:
            def run(sched, x, y, *, reps=1):
                f = _loss_only(pipeline(mdl, sched, sum_grads=False), mesh)
                f(params, x, y)  # warm-up
                with cfx.memory.track() as mem, pipeline.trace() as tr:
                    for _ in range(reps):
                        f(params, x, y)
                peaks = [mem.peak_by_kind("device", rank=r).get("activation", 0) for r in range(p)]
                return peaks, [tr.timeline(step=k).bubble_fraction for k in range(reps)]
            unit, _ = run(pipeline.gpipe(p, 1), *batch(1))  # one microbatch's activations
            for m in sorted(m for q, m in grid if q == p):
                for name, sched in schedules(p, m).items():
                    peaks, bubbles = run(sched, *batch(m), reps=rounds)
                    bubble = statistics.median(bubbles)
                    rows.append(Row(f"measured bubble, {name}, p={p} m={m} (local mesh, median of "
                                    f"{rounds})", bubble, "fraction", "info"))
                    per_stage = "/".join(f"{b / 1024:.0f}" for b in peaks)
                    label = f"peak activations rank 0, {name}, p={p} m={m} (KiB per rank: {per_stage})"
                    # a chunk holds 1/v of a stage's (equal) blocks: 1/v of a microbatch's worth
                    in_mb = peaks[0] / unit[0]
                    want = sched.peak_in_flight(0, release="W") / sched.n_chunks
                    rows.append(Row(label, in_mb, "microbatches", f"= {want:g}", abs(in_mb - want) < 1e-9))
    return rows


def _loss_only(step, mesh):
    """``step`` over ``mesh``, returning only its loss (the same on every pipe rank).

    The rows read the trace and the memory tracker, never the gradients. With ``sum_grads=False``
    each rank's gradients are its own stages' contributions, different on every pipe rank: no
    out_spec of ``P()`` can describe them, and the all-reduce that would complete them is not part
    of the schedule being measured, so they stay in the body (computed all the same)."""
    return cfx.shard_map(lambda params, x, y: step(params, x, y)[0], mesh=mesh,
                         in_specs=(P(), P(), P()), out_specs=P())


class _TorchStage(nn.Module):
    """Blocks ``lo..hi-1`` of a TorchGPT2, with its embeddings (first) or head (last)."""

    def __init__(self, full: TorchGPT2, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = full.wte, full.wpe
        self.blocks = nn.ModuleList(full.blocks[lo:hi])
        if last:
            self.ln_f = full.ln_f
            self.head = nn.Parameter(full.wte.weight.detach().clone())

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe.weight[:x.shape[1]]  # (b, T, C)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.head.T if self.last else x  # (b, T, V) or (b, T, C)


def _loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _worker(rank: int, p: int, ms: list, rounds: int, init_file: str, out_file: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=p,
                            timeout=datetime.timedelta(seconds=120))
    mdl = model()
    params = mdl.init(cfx.random.key(0))
    results = []
    with cfx.Mesh({"pipe": p}, backend="dist") as mesh:
        for m in ms:
            x, y = batch(m)
            for name, torch_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
                sched = schedules(p, m)[name]
                # each rank holds and differentiates only its own blocks, as torch's stages do
                step = pipeline(mdl, sched, sum_grads=False, local_blocks=True)
                lo, hi = step.plan.bounds[rank], step.plan.bounds[rank + 1]
                stage = _TorchStage(TorchGPT2(mdl.config).load_cfx(params), lo, hi,
                                    first=rank == 0, last=rank == p - 1)
                tsched = torch_cls(PipelineStage(stage, rank, p, torch.device("cpu")), m,
                                   loss_fn=_loss)
                got = {}

                def torch_step():
                    stage.zero_grad(set_to_none=True)
                    losses = []
                    args = (x,) if rank == 0 else ()
                    tsched.step(*args, target=y if rank == p - 1 else None, losses=losses)
                    got["torch"] = float(torch.stack(losses).detach().mean()) if losses else 0.0

                def body(params, x, y):
                    own = {**params, "blocks": [params["blocks"][i] for i in step.held_blocks(rank)]}

                    def cfx_step():
                        got["cfx"] = float(step(own, x, y)[0])
                    got["t"] = lockstep_medians([cfx_step, torch_step], rounds)  # equal on every rank
                    return torch.zeros(())
                cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())(params, x, y)
                losses = torch.tensor([got["cfx"], got["torch"]])
                dist.broadcast(losses, p - 1)  # the last stage knows the losses
                results.append(dict(name=name, m=m, t=got["t"], loss=losses.tolist()))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    end_worker()


def torch_rows(p: int, ms: list, rounds: int) -> list[Row]:
    fd, init_file = tempfile.mkstemp(prefix="cfx-bench-pp-init-")
    os.close(fd)
    os.remove(init_file)
    fd, out_file = tempfile.mkstemp(prefix="cfx-bench-pp-out-", suffix=".json")
    os.close(fd)
    try:
        mp.start_processes(_worker, args=(p, ms, rounds, init_file, out_file), nprocs=p,
                           start_method="spawn", join=True)
        with open(out_file) as f:
            results = json.load(f)
    except Exception as e:  # noqa: BLE001 - reported as a row, never faked
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        return [Row(f"step time cfx/torch.distributed.pipelining, p={p}: not available ({reason})",
                    float("nan"), "x", "info")]
    finally:
        os.remove(out_file)
    rows = []
    for r in results:
        (t_cfx, t_torch), (l_cfx, l_torch) = r["t"], r["loss"]
        what = f"{r['name']}, p={p} m={r['m']} ({p} gloo processes)"
        if r["name"] == "1f1b" and r["m"] == NAMED_M:
            rows.append(Row(f"1f1b_vs_torch_{p}stages", t_cfx / t_torch, "x", "<= 1.00", t_cfx <= t_torch))
        else:
            rows.append(Row(f"step time ratio cfx/torch.distributed.pipelining, {what}", t_cfx / t_torch,
                            "x", "info"))
        rows.append(Row(f"step time cfx.pipeline, {what} (median)", t_cfx, "s"))
        rows.append(Row(f"step time torch.distributed.pipelining, {what} (median)", t_torch, "s"))
        rows.append(Row(f"loss |cfx - torch|, {what}", abs(l_cfx - l_torch), "nats", "<= 1e-4",
                        abs(l_cfx - l_torch) <= 1e-4))
    return rows


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    ps, ms, rounds, torch_rounds = SIZES[size_of(quick=quick, smoke=smoke)]
    grid = [(p, m) for p in ps for m in ms]
    rows = simulated_rows([(p, m) for p in (2, 4) for m in (4, 8, 16)])
    rows += measured_rows(grid, rounds)
    for p in ps:
        rows += torch_rows(p, list(ms), torch_rounds)
    return report("pipeline", rows, json_path)
