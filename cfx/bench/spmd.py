"""SPMD runtime figures: mesh start-up, shard_map overhead, collective throughput, reshard bytes.

* start-up: a ``local`` Mesh to its first completed psum vs ``torch.multiprocessing`` spawning the
  same number of gloo processes to their first all-reduce;
* per-call overhead of ``shard_map`` on an identity function;
* all-reduce throughput through ``cfx.lax.psum`` vs raw ``ProcessGroupGloo.allreduce`` on the
  same groups and sizes (ratio, target >= 0.9);
* bytes moved per rank by ``reshard`` vs gather-then-split on a table of spec pairs;
* ``collective_check_overhead``: a data x tensor parallel GPT-2 train step (a Plan, 4 ranks) on a
  mesh that matches every collective across ranks (``check_collectives``, the local default) over
  the same step on a mesh that does not (target <= 1.05);
* ``replication_check_overhead``: a DP x TP GPT-2 step whose params come back replicated over
  ``data``, with shard_map's default ``check_rep`` (a sample of each leaf compared across its
  replicas) and with ``"full"``, over the same step with ``check_rep=False``.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfx
from cfx import P
from cfx.bench.common import Row, interleaved_medians, report, size_of


def _mp_worker(rank: int, size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                           timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1)
    dist.all_reduce(x)
    dist.destroy_process_group()


def mp_startup(size: int) -> float:
    fd, path = tempfile.mkstemp(prefix="cfx-bench-init-")
    os.close(fd)
    os.remove(path)
    t0 = time.perf_counter()
    mp.start_processes(_mp_worker, args=(size, path), nprocs=size, start_method="spawn", join=True)
    return time.perf_counter() - t0


def local_startup(size: int) -> float:
    t0 = time.perf_counter()
    with cfx.Mesh({"data": size}) as mesh:
        cfx.shard_map(lambda x: cfx.lax.psum(x, "data"), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(1))
        elapsed = time.perf_counter() - t0
    return elapsed


def shard_map_overhead_us(size: int, calls: int) -> float:
    with cfx.Mesh({"data": size}) as mesh:
        f = cfx.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P())
        x = torch.ones(4)
        f(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            f(x)
        return (time.perf_counter() - t0) / calls * 1e6


def allreduce_ratio(size: int, numel: int, reps: int) -> tuple[float, float, float]:
    """(cfx seconds per psum, raw gloo seconds per allreduce, raw / cfx)."""
    with cfx.Mesh({"data": size}) as mesh:
        def body(x):
            cfx.lax.psum(x, "data")  # make the group
            t0 = time.perf_counter()
            for _ in range(reps):
                cfx.lax.psum(x, "data")
            return torch.tensor([time.perf_counter() - t0])
        x = torch.randn(numel)
        t_cfx = float(cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))(x)).max()) / reps

    store = dist.HashStore()
    pgs = [None] * size
    times = [0.0] * size

    def worker(r):
        pgs[r] = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), r, size, datetime.timedelta(seconds=60))
        y = x.clone()
        pgs[r].allreduce([y]).wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            y = x.clone()  # psum returns a fresh tensor: do the same copy here
            pgs[r].allreduce([y]).wait()
        times[r] = time.perf_counter() - t0
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        torch.set_num_threads(saved)
    t_raw = max(times) / reps
    return t_cfx, t_raw, t_raw / t_cfx


RESHARD_PAIRS = [
    ({"a": 2, "b": 2}, (64, 64), P("a", "b"), P("b", "a")),
    ({"a": 2, "b": 2}, (64, 64), P("a", None), P(None, "a")),
    ({"a": 2, "b": 2}, (64, 64), P(("a", "b")), P(None, ("a", "b"))),
    ({"a": 4}, (64, 64), P("a"), P()),
    ({"a": 2, "b": 4}, (64, 64), P("a", "b"), P()),
    ({"a": 2, "b": 4}, (64, 64), P(None, ("a", "b")), P("b", "a")),
    ({"a": 2, "b": 2, "c": 2}, (16, 16, 16), P("a", "b", "c"), P("c", "a", "b")),
]


SIZES = {
    # starts: (local mesh sizes, tries of each, the sizes also started as spawned processes); calls: identity
    # shard_maps timed; psum: (sizes, repeats); layers: the GPT-2 of the two check rows; check_rounds and
    # rep_rounds: their interleaved rounds; posts: ledger posts timed
    "smoke": dict(starts=((2,), 1, (2,)), calls=5, psum=((1 << 10,), 2), layers=1, check_rounds=1, posts=100,
                  rep_rounds=1),
    "quick": dict(starts=((2, 4, 8), 3, (2,)), calls=50, psum=((1 << 16,), 20), layers=2, check_rounds=30,
                  posts=10_000, rep_rounds=60),
    "full": dict(starts=((2, 4, 8), 3, (2, 4, 8)), calls=500, psum=((1 << 10, 1 << 16, 1 << 20), 100), layers=4,
                 check_rounds=60, posts=100_000, rep_rounds=60),
}


def collective_check_overhead(*, layers: int, rounds: int) -> tuple[float, float, int]:
    """``(ratio checked/unchecked, unchecked step s, collectives per step)`` of a DP x TP GPT-2 step."""
    model = cfx.models.gpt2("tiny", vocab_size=256, n_positions=64, n_layer=layers)
    plan = cfx.parallel.Plan.parse("data=2,model=2")
    tokens = cfx.random.randint(cfx.random.key(1), (8, 65), 0, 256)
    batch = (tokens[:, :-1], tokens[:, 1:])
    with plan.make_mesh(check_collectives=True) as on, plan.make_mesh(check_collectives=False) as off:
        steps, states = {}, {}
        for name, mesh in (("on", on), ("off", off)):
            steps[name] = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
            states[name] = steps[name].init(cfx.random.key(0))

        def runner(name):
            def f():
                states[name], metrics = steps[name](states[name], batch)
                float(metrics["loss"])
            return f
        t_on, t_off = interleaved_medians([runner("on"), runner("off")], rounds=rounds, warmup=min(2, rounds))
        with cfx.comm_stats() as stats:
            runner("off")()
        per_step = len(stats.records) // plan.size("data") // plan.size("model")
    return t_on / t_off, t_off, per_step


def replication_check_overhead(*, layers: int, rounds: int) -> tuple[float, float, float]:
    """``(ratio sampled/unchecked, ratio full/unchecked, unchecked step s)`` of a DP x TP GPT-2
    SGD step whose params come back replicated over ``data`` (every leaf checked); a few % of
    noise at fewer than 60 rounds."""
    from cfx.parallel import MEGATRON_RULES, tensor_parallel, tree_pmean
    model = cfx.models.gpt2("tiny", vocab_size=256, n_positions=64, n_layer=layers)
    net, tx = tensor_parallel(model, "model"), cfx.optim.sgd(1e-3)
    tokens = cfx.random.randint(cfx.random.key(1), (8, 65), 0, 256)

    def body(p, t):
        loss, g = cfx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
        u, _ = tx.update(tree_pmean(g, "data"), tx.init(p), p)
        return cfx.optim.apply_updates(p, u), cfx.lax.pmean(loss, "data")

    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        specs = cfx.Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        params = {m: cfx.init_sharded(model.init, cfx.random.key(0), mesh=mesh, specs=specs)
                  for m in ("off", "on", "full")}
        steps = {m: cfx.shard_map(body, mesh=mesh, in_specs=(specs, P("data")), out_specs=(specs, P()),
                                  check_rep={"off": False, "on": True, "full": "full"}[m], donate_argnums=0)
                 for m in params}

        def runner(m):
            def f():
                params[m], loss = steps[m](params[m], tokens)
                float(cfx.device_get(loss))
            return f
        t_off, t_on, t_full = interleaved_medians([runner(m) for m in ("off", "on", "full")],
                                                  rounds=rounds, warmup=min(2, rounds))
    return t_on / t_off, t_full / t_off, t_off


def ledger_post_us(posts: int) -> float:
    """Microseconds one rank spends matching one collective in the local backend's ledger."""
    from cfx._src.mesh.ledger import Call, Ledger
    with cfx.Mesh({"data": 2}) as mesh:
        ledger = Ledger(mesh)
        ledger.begin(0)
        call = Call("all_reduce[sum]", ("data",), ((1024,),), torch.float32)
        t0 = time.perf_counter()
        for seq in range(posts):
            ledger.post("bench", (0, 1), seq, 0, call)
            ledger.post("bench", (0, 1), seq, 1, call)
        return (time.perf_counter() - t0) / (2 * posts) * 1e6


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    z = SIZES[size_of(quick=quick, smoke=smoke)]
    rows = []
    sizes, repeats, spawned = z["starts"]
    for n in sizes:
        t_local = min(local_startup(n) for _ in range(repeats))
        rows.append(Row(f"local mesh startup, {n} ranks (to first psum)", t_local, "s",
                        "< 1 s" if n == 8 else "", t_local < 1.0 if n == 8 else True))
        if n in spawned:
            t_mp = mp_startup(n)
            rows.append(Row(f"torch.multiprocessing gloo startup, {n} ranks (to first all_reduce)", t_mp, "s"))
            rows.append(Row(f"startup ratio mp/local, {n} ranks", t_mp / t_local, "x"))
    rows.append(Row("shard_map per-call overhead, identity, 4 ranks", shard_map_overhead_us(4, z["calls"]), "us"))
    numels, reps = z["psum"]
    for numel in numels:
        t_cfx, t_raw, ratio = allreduce_ratio(4, numel, reps)
        gbs = numel * 4 / t_cfx / 1e9
        rows.append(Row(f"psum throughput ratio raw/cfx, 4 ranks, {numel * 4 // 1024} KiB", ratio, "x",
                        ">= 0.9", ratio >= 0.9))
        rows.append(Row(f"psum algorithm bandwidth, 4 ranks, {numel * 4 // 1024} KiB", gbs, "GB/s"))
    for shape, tshape, src, dst in RESHARD_PAIRS:
        with cfx.Mesh(shape) as mesh:
            arr = cfx.device_put(torch.zeros(tshape), mesh, src)
            plan = cfx.reshard_plan(arr, dst)
        rows.append(Row(f"reshard {src}->{dst} on {shape}: bytes/rank (gather-then-split {plan.naive_bytes:,.0f})",
                        plan.nbytes, "B", "<= gather-then-split", plan.nbytes <= plan.naive_bytes))
    ratio, t_off, per_step = collective_check_overhead(layers=z["layers"], rounds=z["check_rounds"])
    rows.append(Row("collective_check_overhead (DP x TP GPT-2 step, 4 ranks, checked/unchecked)", ratio, "x",
                    "<= 1.05", ratio <= 1.05))
    rows.append(Row("  unchecked step time", t_off, "s"))
    rows.append(Row("  collectives per rank per step", per_step, "count"))
    rows.append(Row("  ledger matching cost per collective per rank", ledger_post_us(z["posts"]), "us"))
    on, full, t_off = replication_check_overhead(layers=z["layers"], rounds=z["rep_rounds"])
    rows.append(Row("replication_check_overhead (DP x TP GPT-2 step, 4 ranks, sampled check_rep/off)", on, "x",
                    "<= 1.05", on <= 1.05))
    rows.append(Row("  check_rep='full' / off", full, "x"))
    rows.append(Row("  unchecked step time", t_off, "s"))
    return report("spmd", rows, json_path)
