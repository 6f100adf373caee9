"""Data-parallel and ZeRO-3 GPT-2 training runs, used by test_dist.py on both mesh backends.

Run as ``torchrun --nproc-per-node 4 -m cfx_tests.dp_train_script`` (dist backend) or call
``data_parallel("local")`` (``jit=True``: compiled) / ``zero3("local")``. Prints the losses as JSON on rank 0. Params and
optimizer state stay ShardedArrays between steps; under torchrun each process holds only its own
rank's blocks, which the ZeRO-3 run checks.
"""
import json

import torch

import cfx
from cfx import P

STEPS, BATCH, SEQ = 3, 8, 16


def setup(n_layer: int = 2):
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=n_layer, n_embd=32, n_head=2, n_positions=SEQ)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (STEPS, BATCH, SEQ + 1), 0, 64)
    return model, params, tokens, cfx.optim.adamw(1e-2, weight_decay=0.1)


def single_device() -> list[float]:
    model, params, tokens, tx = setup()
    state, losses = tx.init(params), []
    for t in tokens:
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        losses.append(float(loss))
    return losses


def data_parallel(backend: str, *, jit: bool = False, n_layer: int = 2) -> list[float]:
    """``jit``: the step compiled (``cfx.jit(shard_map(step))``: a graph per rank, the params and
    optimizer state donated)."""
    model, params, tokens, tx = setup(n_layer)

    def step(params, state, batch):  # runs per rank on its batch shard
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, batch[:, :-1], batch[:, 1:]))(params)
        grads = cfx.tree.map(lambda g: cfx.lax.pmean(g, "data"), grads)  # equal shards: mean of means
        updates, state = tx.update(grads, state, params)
        return cfx.optim.apply_updates(params, updates), state, cfx.lax.pmean(loss, "data")

    with cfx.Mesh({"data": 4}, backend=backend, timeout=60) as mesh:
        train_step = cfx.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
        if jit:
            train_step = cfx.jit(train_step, donate_argnums=(0, 1), backend="aot_eager")
        state, losses = tx.init(params), []
        for t in tokens:
            params, state, loss = train_step(params, state, t)
            losses.append(float(loss))
    return losses


def zero3(backend: str) -> tuple[list[float], int]:
    """ZeRO-3 over data: ``(losses, bytes of params + optimizer state this process holds)``."""
    model, _, tokens, tx = setup()
    ztx = cfx.zero(tx, stage=3, axis="data")
    net = cfx.zero.gathered(model.map_blocks(lambda b: cfx.zero.gathered(b, axis="data")), axis="data")

    def step(p, state, batch):
        loss, grads = ztx.value_and_grad(lambda p: net.loss(p, batch[:, :-1], batch[:, 1:]))(p)
        updates, state = ztx.update(grads, state, p)
        return cfx.optim.apply_updates(p, updates), state, cfx.lax.pmean(loss, "data")

    with cfx.Mesh({"data": 4}, backend=backend, timeout=60) as mesh:
        shapes = cfx.eval_shape(model.init, cfx.random.key(0))
        pspecs = cfx.zero.param_specs(None, shapes, axis="data", mesh=mesh)
        sspecs = ztx.state_specs(shapes, mesh=mesh)
        params = cfx.zero.init_params(model.init, cfx.random.key(0), mesh=mesh, axis="data")
        state = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs)(params)
        train_step = cfx.shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, P("data")),
                                   out_specs=(pspecs, sspecs, P()), donate_argnums=(0, 1))
        losses = []
        for t in tokens:
            params, state, loss = train_step(params, state, t)
            losses.append(float(loss))
        arrays = [x for x in cfx.tree.leaves((params, state)) if isinstance(x, cfx.ShardedArray)]
        assert all(sorted(x.blocks) == mesh.local_ranks for x in arrays)  # only this process's blocks
        held = sum(x.addressable_nbytes for x in arrays)
    return losses, held


if __name__ == "__main__":
    import os
    losses = data_parallel("dist")
    jit_losses = data_parallel("dist", jit=True, n_layer=1)
    z_losses, z_held = zero3("dist")
    if os.environ.get("RANK", "0") == "0":
        import torch.distributed as dist
        print("BACKEND", dist.get_backend(), flush=True)  # the world cfx's dist backend made
        print("LOSSES", json.dumps(losses), flush=True)
        print("JIT", json.dumps(jit_losses), flush=True)
        print("ZERO3", json.dumps({"losses": z_losses, "held": z_held}), flush=True)
