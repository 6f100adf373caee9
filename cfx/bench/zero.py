"""ZeRO stages 0-3 against the paper's figures, and ZeRO-3 step time against torch FSDP2.

* per rank and step, elements moved by collectives over the ZeRO axis, as a ratio to the paper's
  ``2 Psi (N-1)/N`` (stages 0-2) or ``3 Psi (N-1)/N`` less the model root's backward re-gather,
  which cfx saves (stage 3; ``root_elements``); ``cfx.comm_stats`` records
  what each rank contributes, converted to elements sent by ring algorithms (all-gather
  ``S (N-1)``, reduce-scatter ``numel (N-1)/N``, all-reduce ``2 numel (N-1)/N``); ok within 1%
  plus the per-leaf padding;
* per rank, live model-state bytes (``cfx.memory`` kinds param + grad + optim) once the gradients
  exist, as a ratio to the mixed-precision Adam formulas (16 Psi; 4 Psi + 12 Psi/N;
  2 Psi + 14 Psi/N; 16 Psi/N), with bf16 params; ok within one chunk (a block's fp32 shard);
* step time of ZeRO-3 (``cfx.zero.gathered`` blocks and model, AdamW, params and state kept as
  donated ShardedArrays between steps on a ``dist`` mesh) vs torch's ``fully_shard`` (FSDP2,
  each block and the model, ``torch.optim.AdamW``) on the same GPT-2, both in the same gloo
  processes (one per rank), steps alternating, each started on every rank together (a barrier)
  and lasting as long as its slowest rank: rows ``zero3_vs_fsdp2_n{N}`` (target <= 1.00).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfx
from cfx import P
from cfx import zero
from cfx._src.zero.flat import piece_size
from cfx.bench.common import Row, end_worker, lockstep_medians, report, size_of, skipped

SENT = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n}
STATE = {0: lambda p, n: 16 * p, 1: lambda p, n: 4 * p + 12 * p / n,
         2: lambda p, n: 2 * p + 14 * p / n, 3: lambda p, n: 16 * p / n}


def root_elements(params, n: int) -> int:
    """The padded elements of the params outside the blocks (embeddings, final norm): the model's
    root, which ZeRO-3 keeps gathered from its forward into its backward (``zero.gathered``), so
    a step moves ``3 Psi - root`` elements' worth per rank, not the paper's ``3 Psi``."""
    return sum(piece_size(x.numel(), n) * n for k, v in params.items() if k != "blocks"
               for x in cfx.tree.leaves(v))


SIZES = {  # size -> (GPT-2, ZeRO axis sizes, FSDP2 peer's process counts, its rounds)
    "smoke": (dict(n_layer=1, vocab_size=64, n_embd=32, n_head=2, n_positions=8), (2,), (2,), 1),
    "quick": (dict(n_layer=2, vocab_size=256, n_embd=64, n_head=4, n_positions=16), (2, 4, 8), (2,), 5),
    "full": (dict(n_layer=4, vocab_size=1024, n_embd=128, n_head=4, n_positions=64), (2, 4, 8), (2, 4), 30),
}


def _gathered(model):
    return zero.gathered(model.map_blocks(lambda b: zero.gathered(b, axis="data")), axis="data")


def measure(model, stage: int, n: int, *, dtype=torch.bfloat16, steps: int = 2, batch: int = 8,
            backend: str = "local"):
    """(comm records of rank 0's last step, rank 0's model-state bytes, median step seconds)."""
    net = _gathered(model) if stage == 3 else model
    ztx = zero(cfx.optim.adamw(1e-3), stage=stage, axis="data", bucket_numel=1 << 18)
    T = model.config.n_positions
    tokens = cfx.random.randint(cfx.random.key(1), (steps, batch, T + 1), 0, model.config.vocab_size)

    def body(params, tokens):
        p = zero.shard_params(params, axis="data") if stage == 3 else cfx.tree.map(torch.clone, params)
        state, times, state_bytes = ztx.init(p), [], 0
        for t in tokens:
            t0 = time.perf_counter()
            with cfx.comm_stats() as stats:
                _, grads = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
                state_bytes = sum(mem.live("device", rank=cfx.lax.axis_index("data"), kind=k)
                                  for k in ("param", "grad", "optim"))
                u, state = ztx.update(grads, state, p)
            p = cfx.optim.apply_updates(p, u)
            times.append(time.perf_counter() - t0)
        return stats.records, state_bytes, torch.tensor([statistics.median(times[1:] or times)])

    params = cfx.tree.map(lambda x: x.to(dtype), model.init(cfx.random.key(0)))
    with cfx.memory.track() as mem, cfx.Mesh({"data": n}, backend=backend) as mesh:
        records, nbytes, t = cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "data")),
                                           out_specs=(P(), P(), P("data")))(params, tokens)
        t = cfx.device_get(t)  # every process's step time (a collective under dist)
    return [r for r in records if r.rank == 0 and r.axes == ("data",)], nbytes, float(t.max())


def _zero3_step(model):
    """ZeRO-3 AdamW (lr 1e-3) over ``data`` on the gathered model, and the ``shard_map`` body of one
    step on tokens ``(B, T + 1)``: ``(optimizer, step(params, state, tokens) -> (params, state, loss))``."""
    ztx = zero(cfx.optim.adamw(1e-3), stage=3, axis="data")
    net = _gathered(model)

    def step(p, state, t):
        loss, grads = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
        updates, state = ztx.update(grads, state, p)
        return cfx.optim.apply_updates(p, updates), state, cfx.lax.pmean(loss, "data")
    return ztx, step


def _peer_worker(rank: int, init_file: str, out_file: str, n: int, cfg: dict, rounds: int, batch: int) -> None:
    """cfx ZeRO-3 (a ``dist`` mesh) and FSDP2 ``fully_shard`` on the same GPT-2 in the same gloo
    processes, steps alternating round by round (``lockstep_medians``); rank 0 writes each side's
    median step seconds and the first step's losses."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=300))
    times, losses = _race(rank, n, cfg, rounds, batch)
    fsdp_loss = torch.tensor([losses["fsdp2"]])
    dist.all_reduce(fsdp_loss)  # each rank's loss is of its own rows: their mean is cfx's loss
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"cfx": times[0].item(), "fsdp2": times[1].item(), "loss_cfx": losses["cfx"],
                       "loss_fsdp2": fsdp_loss.item() / n}, f)
    dist.destroy_process_group()
    end_worker()


def _race(rank: int, n: int, cfg: dict, rounds: int, batch: int) -> tuple[torch.Tensor, dict]:
    """The median step seconds (cfx, FSDP2) over the world, and this rank's first losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cfx.bench.torch_gpt2 import TorchGPT2
    model = cfx.models.gpt2("tiny", **cfg)
    T = model.config.n_positions
    tokens = cfx.random.randint(cfx.random.key(1), (batch, T + 1), 0, model.config.vocab_size)

    m = TorchGPT2(model.config).load_cfx(model.init(cfx.random.key(0)))
    for b in m.blocks:
        fully_shard(b, mesh=init_device_mesh("cpu", (n,)))
    fully_shard(m, mesh=init_device_mesh("cpu", (n,)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    mine = tokens.chunk(n)[rank]
    losses = {}

    def fsdp_step():
        loss = m(mine[:, :-1], mine[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.setdefault("fsdp2", float(loss.detach()))

    ztx, step = _zero3_step(model)

    with cfx.Mesh({"data": n}, backend="dist") as mesh:
        shapes = cfx.eval_shape(model.init, cfx.random.key(0))
        pspecs = zero.param_specs(None, shapes, axis="data", mesh=mesh)
        sspecs = ztx.state_specs(shapes, mesh=mesh)
        held = {"params": zero.init_params(model.init, cfx.random.key(0), mesh=mesh, axis="data")}
        held["state"] = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs)(held["params"])
        train_step = cfx.shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, P("data")),
                                   out_specs=(pspecs, sspecs, P()), donate_argnums=(0, 1))

        def cfx_step():
            held["params"], held["state"], loss = train_step(held["params"], held["state"], tokens)
            if "cfx" not in losses:
                losses["cfx"] = float(cfx.device_get(loss))

        times = torch.tensor(lockstep_medians([cfx_step, fsdp_step], rounds))  # equal on every rank
    return times, losses


def spawned(worker, nprocs: int, *args) -> dict:
    """``worker(rank, init_file, out_file, *args)`` in ``nprocs`` spawned processes (a world rendezvousing on
    ``init_file``); the JSON rank 0 wrote to ``out_file``. Both files are removed however it ends."""
    fd, init_file = tempfile.mkstemp(prefix="cfx-bench-")
    os.close(fd)
    os.remove(init_file)
    out_file = init_file + ".out"
    try:
        mp.start_processes(worker, args=(init_file, out_file, *args), nprocs=nprocs, start_method="spawn", join=True)
        with open(out_file) as f:
            return json.load(f)
    finally:
        for p in (init_file, out_file):
            if os.path.exists(p):
                os.remove(p)


def peer_step_times(cfg: dict, n: int, rounds: int, batch: int) -> tuple[dict | None, str]:
    """``_peer_worker``'s results in n spawned gloo processes, or ``(None, why it could not run)``."""
    try:
        return spawned(_peer_worker, n, n, cfg, rounds, batch), ""
    except Exception as e:  # noqa: BLE001 - reported in the row, not faked
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def peer_rows(cfg: dict, ns: tuple, rounds: int, batch: int) -> list[Row]:
    rows = []
    for n in ns:
        got, why = peer_step_times(cfg, n, rounds, batch)
        if got is None:
            rows.append(Row(f"zero3_vs_fsdp2_n{n}: could not run ({why})", float("nan"), "x", "<= 1.00", False))
            continue
        rows.append(Row(f"ZeRO-3 step time, N={n} gloo processes (median of {rounds}, lockstep)", got["cfx"], "s"))
        rows.append(Row(f"FSDP2 fully_shard step time, N={n}, same processes, lockstep", got["fsdp2"], "s"))
        ratio = got["cfx"] / got["fsdp2"]
        rows.append(Row(f"zero3_vs_fsdp2_n{n}", ratio, "x", "<= 1.00", ratio <= 1.0))
        gap = abs(got["loss_cfx"] - got["loss_fsdp2"])
        rows.append(Row(f"first-step loss |cfx - FSDP2|, N={n}", gap, "nats", "<= 1e-4", gap <= 1e-4))
    return rows


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    cfg, ns, peer_ns, peer_rounds = SIZES[size_of(quick=quick, smoke=smoke)]
    model = cfx.models.gpt2("tiny", **cfg)
    params = model.init(cfx.random.key(0))
    numels = [x.numel() for x in cfx.tree.leaves(params)]
    psi = sum(numels)
    block = sum(x.numel() for x in cfx.tree.leaves(params["blocks"][0]))
    rows = [Row(f"GPT-2 {cfg['n_layer']}x{cfg['n_embd']}, vocab {cfg['vocab_size']}: Psi", psi, "params")]
    for n in ns:
        padded = sum(piece_size(m, n) * n for m in numels)
        for stage in (0, 1, 2, 3):
            records, nbytes, _ = measure(model, stage, n)
            k = 3 if stage == 3 else 2
            kept = root_elements(params, n) if stage == 3 else 0  # the root's re-gather, saved
            target = (k * psi - kept) * (n - 1) / n
            moved = sum(r.numel * SENT[r.op](n) for r in records)
            slack = 0.01 + k * (padded - psi) * (n - 1) / n / target
            what = f"{k} Psi - root" if stage == 3 else f"{k} Psi"
            rows.append(Row(f"stage {stage}, N={n}: comm elements/step / ({what}) (N-1)/N", moved / target, "x",
                            f"1 +- {slack:.4f}", abs(moved / target - 1) <= slack))
            if stage == 3:
                rows.append(Row(f"stage 3, N={n}: comm elements/step / the paper's 3 Psi (N-1)/N",
                                moved / (k * psi * (n - 1) / n), "x", "info"))
            want = STATE[stage](psi, n)
            chunk = 4 * block / n
            rows.append(Row(f"stage {stage}, N={n}: model-state bytes/rank / formula (bf16 Adam)", nbytes / want,
                            "x", f"1 +- {chunk / want:.4f} (one chunk)", abs(nbytes - want) <= chunk))
    rows += peer_rows(cfg, peer_ns, peer_rounds, 8)
    return report("zero", rows, json_path)


def _backend_worker(rank: int, init_file: str, out_file: str, cfg: dict) -> None:
    """One process, world of one: the same ZeRO-3 GPT-2 steps (fp64, 3 AdamW steps) with CUDA tensors,
    whose collectives go to NCCL, and with CPU tensors, whose collectives go to gloo, in one
    ``cpu:gloo,cuda:nccl`` world (``cfx``'s ``dist`` backend's); rank 0 writes both runs' losses and params."""
    from cfx._src.mesh.dist import world_backend

    backend = world_backend()
    if "nccl" in backend:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    out = {"backend": backend}
    with cfx.Mesh({"data": 1}, backend="dist") as mesh:
        for device in ["cpu"] + (["cuda"] if "nccl" in backend else []):
            out[device] = _zero3_steps(mesh, cfg, device)
    with open(out_file, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    end_worker()


def _zero3_steps(mesh, cfg: dict, device: str) -> dict:
    """3 ZeRO-3 AdamW steps of a fp64 GPT-2 on ``device``: losses, the params after, collectives issued."""
    model = cfx.models.gpt2("tiny", **cfg)
    T = model.config.n_positions
    tokens = cfx.random.randint(cfx.random.key(1), (4, T + 1), 0, model.config.vocab_size).to(device)
    ztx, step = _zero3_step(model)

    init = lambda key: cfx.tree.map(lambda x: x.to(device, torch.float64), model.init(key))  # noqa: E731
    shapes = cfx.eval_shape(init, cfx.random.key(0))
    pspecs = zero.param_specs(None, shapes, axis="data", mesh=mesh)
    sspecs = ztx.state_specs(shapes, mesh=mesh)
    with torch.device(device):  # where the sharded init allocates the pieces (cfx.random draws on the CPU)
        params = zero.init_params(init, cfx.random.key(0), mesh=mesh, axis="data")
        state = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs)(params)
    train_step = cfx.shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, P("data")), out_specs=(pspecs, sspecs, P()))
    losses = []
    with cfx.comm_stats() as stats:
        for _ in range(3):
            params, state, loss = train_step(params, state, tokens)
            losses.append(float(cfx.device_get(loss)))
    flat = torch.cat([cfx.device_get(x).reshape(-1).cpu() for x in cfx.tree.leaves(params)])
    return {"losses": losses, "params": flat.tolist(), "collectives": len(stats.records)}


def nccl_rows(*, smoke: bool = False) -> list[Row]:
    """``nccl_zero3_equals_gloo``: ``_backend_worker``'s CUDA (NCCL) run against its CPU (gloo) run, fp64:
    the largest parameter difference after 3 steps, relative to the largest parameter (a world of one
    GPU: NCCL's code path, not multi-GPU traffic). Without CUDA the gloo run alone (the path)."""
    cfg = SIZES["smoke" if smoke else "quick"][0]
    got = spawned(_backend_worker, 1, cfg)
    cpu = got["cpu"]
    rows = [Row(f"  ZeRO-3 3 steps fp64 on gloo (world {got['backend']}): losses {cpu['losses']}",
                cpu["collectives"], "collectives")]
    if "cuda" not in got:
        return rows + [skipped("nccl_zero3_equals_gloo", "equal (fp64: <= 1e-12 relative)")]
    a, b = torch.tensor(got["cuda"]["params"], dtype=torch.float64), torch.tensor(cpu["params"], dtype=torch.float64)
    rel = float((a - b).abs().max() / b.abs().max())
    return rows + [Row(f"  ZeRO-3 on NCCL: losses {got['cuda']['losses']}", got["cuda"]["collectives"], "collectives"),
                   Row("nccl_zero3_equals_gloo (max |params NCCL - gloo| / max |params|, fp64, 3 steps)", rel, "",
                       "equal (fp64: <= 1e-12 relative)", rel <= 1e-12 and got["cuda"]["collectives"] > 0)]
