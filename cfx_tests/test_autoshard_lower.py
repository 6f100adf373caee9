"""The lowered plan computes what one device computes: GPT-2, Llama and BERT's loss and every
gradient (fp32, ``assert_close`` defaults) for the plan the search picks, and for any assignment
of strategies drawn at random (hypothesis) -- every layout change between them, every partial
sum, every size argument rewritten to a block."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import cfx
from cfx._src.autoshard.graph import trace
from cfx._src.autoshard.lower import lower
from cfx._src.autoshard.strategies import strategies

MODELS = {
    "gpt2": lambda: cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_positions=16, n_embd=32, n_head=4),
    "llama": lambda: cfx.models.llama("tiny", n_layer=1, vocab_size=64, hidden_size=32, n_head=4, n_kv_heads=2,
                                      intermediate_size=64, max_position_embeddings=16),
    "bert": lambda: cfx.models.bert("tiny", n_layer=1, vocab_size=64, max_position_embeddings=16, hidden_size=32,
                                    n_head=4, intermediate_size=64),
}
MESHES = ({"data": 2, "model": 2}, {"model": 4})


@functools.lru_cache(maxsize=None)
def case(name: str):
    model = MODELS[name]()
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (8, 9), 0, 64)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, grads = cfx.value_and_grad(model.loss)(params, x, y)
    return model, params, (x, y), trace(model.loss, params, x, y), (loss, grads)


def random_choices(graph, mesh_shape: dict, rng: np.random.Generator) -> list:
    """One strategy per op drawn at random (a getitem takes the one its op's choice gives)."""
    nodes = list(graph.module.graph.nodes)[:-1]
    index = {n: i for i, n in enumerate(nodes)}
    picked: list = []
    for n in nodes:
        options = strategies(n, mesh_shape)
        if options[0].source is not None:
            options = [o for o in options if o.source == picked[index[n.args[0]]][0]]
        j = int(rng.integers(len(options)))
        picked.append((j, options[j]))
    return [s for _, s in picked]


def check_equal(name: str, mesh_shape: dict, choices: list) -> None:
    model, params, batch, graph, (want_loss, want_grads) = case(name)
    with cfx.Mesh(mesh_shape) as mesh:
        loss, grads = lower(graph, choices, mesh, param_tree=params, batch_tree=batch)(params, *batch)
        loss, grads = cfx.device_get(loss), cfx.device_get(grads)
    torch.testing.assert_close(loss, want_loss)
    for (path, got), want in zip(cfx.tree.flatten_with_path(grads)[0], cfx.tree.leaves(want_grads)):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name} grad {path} on {mesh_shape}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=3)
@given(seed=st.integers(0, 2**32 - 1), mesh=st.sampled_from(MESHES))
def test_any_assignment_of_strategies_computes_the_single_device_step(name, seed, mesh):
    _, _, _, graph, _ = case(name)
    check_equal(name, mesh, random_choices(graph, mesh, np.random.default_rng(seed)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_searched_plan_computes_the_single_device_step(name):
    model, params, batch, _, (want_loss, want_grads) = case(name)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        step, report = cfx.autoshard(model.loss, mesh, (params, *batch))
        loss, grads = step(step.put(params), *batch)
        torch.testing.assert_close(cfx.device_get(loss), want_loss)
        for got, want in zip(cfx.tree.leaves(cfx.device_get(grads)), cfx.tree.leaves(want_grads)):
            torch.testing.assert_close(got, want)
        assert {k: g.spec for k, g in zip(report.specs, cfx.tree.leaves(grads))} == report.specs
        assert str(report).startswith("cfx.autoshard on mesh {'data': 2, 'model': 2}")
