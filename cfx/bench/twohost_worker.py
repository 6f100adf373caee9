"""One host's process of ``twohost``'s job (run under torchrun, gloo): time all-reduce, all-gather and
reduce-scatter over the two hosts at each size, then train ``data=2`` for a few steps; rank 0 writes
``{"collectives": [{"op", "bytes", "seconds"}], "losses": [...], "params": [...]}`` to ``--out``.

``bytes`` is the whole tensor (the summed one, the gathered one, the one scattered); ``seconds`` the
median of ``--reps`` timings after a warm-up, each the slower rank's (a ``MAX`` all-reduce of the two).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def time_op(op: str, nbytes: int, reps: int) -> float:
    n = dist.get_world_size()
    numel = nbytes // 4
    x = torch.ones(numel)
    part = torch.empty(numel // n)
    whole = torch.empty(numel)

    def once():
        if op == "all_reduce":
            dist.all_reduce(x)
        elif op == "all_gather":
            dist.all_gather_into_tensor(whole, part)
        else:
            dist.reduce_scatter_tensor(part, x)

    once()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        once()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="65536,1048576,8388608")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rows = [{"op": op, "bytes": int(s), "seconds": time_op(op, int(s), a.reps)}
            for s in a.sizes.split(",") for op in ("all_reduce", "all_gather", "reduce_scatter")]
    losses, params = training(a.steps) if a.steps else ([], [])
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"collectives": rows, "losses": losses, "params": params}, f)
    dist.destroy_process_group()


def setup():
    """The model, its batches and optimizer both sides train (the worker over two hosts, the test in one process)."""
    import cfx
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_positions=16)
    tokens = cfx.random.randint(cfx.random.key(1), (4, 8, 17), 0, 64)
    return model, tokens, cfx.optim.adamw(1e-2)


def training(steps: int, plan_text: str = "data=2") -> tuple[list[float], list[float]]:
    """``steps`` steps of ``plan_text`` (one process: ``"single-device"``; under torchrun: over its world):
    the losses and the final params, flat, as float lists."""
    import contextlib

    import cfx
    model, tokens, tx = setup()
    plan = cfx.parallel.Plan.parse(plan_text)
    with plan.make_mesh() if plan.world_size > 1 else contextlib.nullcontext() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        state = step.init(cfx.random.key(0))
        losses = []
        for t in tokens[:steps]:
            state, metrics = step(state, (t[:, :-1], t[:, 1:]))
            losses.append(float(metrics["loss"]))
        params = cfx.device_get(state.params)
    flat = torch.cat([x.reshape(-1).double() for x in cfx.tree.leaves(params)])
    return losses, flat.tolist()


if __name__ == "__main__":
    main()
