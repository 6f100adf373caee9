"""Strategies and the search on a traced step: the specs a mesh allows, and the plan the cost model
picks for a two-layer MLP where the textbook says which wins -- a small batch over large weights
splits the weights over every rank (Megatron's column then row), a huge batch over small weights
keeps them whole (data parallelism) -- a memory budget is met or refused, and an op without
strategies runs replicated with a warning naming it."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from cfx import P
from cfx._src.autoshard.graph import trace
from cfx._src.autoshard.ilp import NoPlanFits
from cfx._src.autoshard.search import search
from cfx._src.autoshard.specs import entries, specs_of
from cfx._src.mesh.mesh import AbstractMesh

MESH = {"data": 2, "model": 2}


def mlp(B: int, D: int, H: int):
    params = {"w1": torch.zeros(D, H), "w2": torch.zeros(H, D)}
    return trace(lambda p, x: (torch.relu(x @ p["w1"]) @ p["w2"]).pow(2).sum(), params, torch.zeros(B, D))


def test_specs_are_every_placement_that_divides():
    shape = (4, 6)
    got = specs_of(shape, {"a": 2, "b": 3})
    assert len(got) == len(set(got))
    for s in got:
        e = entries(s, 2)
        assert sorted(a for d in e for a in d) == sorted({a for d in e for a in d})  # each axis once
        assert all(shape[d] % math.prod({"a": 2, "b": 3}[a] for a in e[d]) == 0 for d in range(2))
    # a: whole, dim 0 or dim 1 (3 places); b: whole or dim 1 (3 does not divide 4) -- with a on dim 1
    # too only when 2 * 3 divides 6
    assert set(got) == {P(), P("a"), P(None, "a"), P(None, "b"), P("a", "b"), P(None, ("a", "b"))}


def test_small_batches_split_the_weights_and_huge_ones_keep_them_whole():
    megatron = search(mlp(8, 1024, 4096), MESH)
    assert megatron.specs == {"w1": P(None, ("data", "model")), "w2": P(("data", "model"))}
    data_parallel = search(mlp(65536, 64, 256), MESH)
    assert data_parallel.specs == {"w1": P(), "w2": P()}
    x = data_parallel.choices[[i for i, o in enumerate(mlp(65536, 64, 256).ops) if o.target == "input"][0]]
    assert x.out == P(("data", "model"))  # the batch split over every rank


def test_a_budget_is_met_or_refused():
    g = mlp(4096, 256, 1024)
    free = search(g, MESH)
    tight = search(g, MESH, budget=free.solution.memory * 0.8)
    assert tight.solution.memory <= free.solution.memory * 0.8
    assert tight.solution.objective >= free.solution.objective
    with pytest.raises(NoPlanFits, match="no strategy assignment fits"):
        search(g, MESH, budget=1000)


def test_an_op_without_strategies_runs_replicated_with_a_warning():
    g = trace(lambda p, x: torch.cumsum(x @ p["w"], 0).sum(), {"w": torch.zeros(8, 8)}, torch.zeros(4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solved = search(g, MESH)
    assert any("no sharding strategies for aten.cumsum.default" in str(w.message) for w in caught)
    cumsum = [i for i, o in enumerate(g.ops) if o.target == "aten.cumsum.default"][0]
    assert solved.choices[cumsum].out == P()


@pytest.mark.timeout(120)
def test_gpt2_is_searched_whole_and_beats_or_equals_megatron_under_the_cost_model():
    import cfx
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=128, n_positions=32, n_embd=64, n_head=4)
    params = model.init(cfx.random.key(0))
    tokens = torch.randint(0, 128, (8, 33))
    g = trace(lambda p, x, y: model.loss(p, x, y), params, tokens[:, :-1], tokens[:, 1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op of GPT-2's step has strategies
        free = search(g, MESH)
    megatron = {path: s for path, s in zip(
        [p for p, _ in cfx.tree.flatten_with_path(params)[0]],
        cfx.tree.leaves(cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=AbstractMesh(MESH)),
                        is_leaf=lambda x: isinstance(x, P)))}
    pinned = search(g, MESH, fixed=megatron)
    assert {k: pinned.specs[k] for k in megatron} == megatron
    assert free.solution.objective <= pinned.solution.objective + 1e-12
    with pytest.raises(ValueError, match="cannot take"):
        search(g, MESH, fixed={"wte.w": P(None, None, "data")})
