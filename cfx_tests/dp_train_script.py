"""A data-parallel GPT-2 training run, used by test_dist.py on both mesh backends.

Run as ``torchrun --nproc-per-node 4 -m cfx_tests.dp_train_script`` (dist backend) or call
``train(backend="local")``. Prints the losses as JSON on rank 0.
"""
import json

import torch

import cfx
from cfx import P

STEPS, BATCH, SEQ = 3, 8, 16


def setup():
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_positions=SEQ)
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


def data_parallel(backend: str) -> list[float]:
    model, params, tokens, tx = setup()

    def step(params, state, batch):  # runs per rank on its batch shard
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, batch[:, :-1], batch[:, 1:]))(params)
        grads = cfx.tree.map(lambda g: cfx.lax.pmean(g, "data"), grads)  # equal shards: mean of means
        updates, state = tx.update(grads, state, params)
        return cfx.optim.apply_updates(params, updates), state, cfx.lax.pmean(loss, "data")

    with cfx.Mesh({"data": 4}, backend=backend, timeout=60) as mesh:
        train_step = cfx.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
        state, losses = tx.init(params), []
        for t in tokens:
            params, state, loss = train_step(params, state, t)
            losses.append(float(loss))
    return losses


if __name__ == "__main__":
    import os
    losses = data_parallel("dist")
    if os.environ.get("RANK", "0") == "0":
        print("LOSSES", json.dumps(losses), flush=True)
