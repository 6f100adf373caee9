"""Expert parallelism (``cfx.parallel.expert_parallel``): experts split over an ``expert`` axis, tokens
sent to their experts' ranks by ``cfx.lax.ragged_all_to_all`` and back. The MoE layer and Mixtral
(with its load-balancing loss over the whole batch) equal one device in outputs, loss and every
gradient (fp64), dropless, on 2 and 4 ranks; split inside its experts over a model axis as well
(tensor parallelism) too; in capacity mode with groups (``group_size``) the layer and Mixtral equal
one device running the same groups in outputs, loss, gradients and dropped rows; without groups a
split batch is refused; bad layouts are refused before any collective."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx_tests.budget import examples
from cfx_tests.test_models_mixtral import tiny


def f64(tree):
    return cfx.tree.map(lambda t: t.double() if t.is_floating_point() else t, tree)


@pytest.mark.timeout(120)
@examples(ci=4)
@given(n=st.sampled_from([2, 4]), k=st.integers(1, 2), seed=st.integers(0, 99))
def test_moe_layer_over_an_expert_axis_equals_one_device(n, k, seed):
    layer = cfx.nn.MoE(8, 12, 4, top_k=k)
    p = f64(cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(seed))))
    x = cfx.random.normal(cfx.random.key(seed + 1), (4, 3, 8)).double()
    want, want_grads = cfx.value_and_grad(lambda p, x: layer.apply(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    ep = dataclasses.replace(layer, expert_axis="expert")
    with cfx.Mesh({"expert": n}) as mesh:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(layer.axes(), mesh=mesh)
        run = cfx.shard_map(lambda p, x: cfx.lax.psum(ep.apply(p, x).pow(2).sum(), "expert"), mesh=mesh,
                            in_specs=(specs, P("expert")), out_specs=P())
        got, grads = cfx.value_and_grad(run, argnums=(0, 1))(p, x)
    torch.testing.assert_close(cfx.device_get(got), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cfx.device_get(grads), want_grads, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_mixtral_over_an_expert_axis_equals_one_device(n):
    model = tiny()
    params = f64(model.init(cfx.random.key(0)))
    tokens = cfx.random.randint(cfx.random.key(1), (4, 8), 0, 64)
    targets = cfx.random.randint(cfx.random.key(2), (4, 8), 0, 64)
    want, want_grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
    ep = cfx.parallel.expert_parallel(model)
    with cfx.Mesh({"expert": n}) as mesh:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(model.axes(), mesh=mesh)
        run = cfx.shard_map(lambda p, x, y: cfx.lax.pmean(ep.loss(p, x, y), "expert"), mesh=mesh,
                            in_specs=(specs, P("expert"), P("expert")), out_specs=P())
        got, grads = cfx.value_and_grad(run)(params, tokens, targets)
    # the cross-entropy runs in fp32 (cfx's loss): the mean of per-rank means differs in its last bits
    torch.testing.assert_close(cfx.device_get(got), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cfx.device_get(grads), want_grads, rtol=1e-6, atol=1e-9)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mesh_shape", [{"model": 2}, {"expert": 2, "model": 2}])
def test_moe_layer_split_inside_its_experts_equals_one_device(mesh_shape):
    layer = cfx.nn.MoE(8, 12, 4, top_k=2)
    p = f64(cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(3))))
    x = cfx.random.normal(cfx.random.key(4), (4, 3, 8)).double()
    want, want_grads = cfx.value_and_grad(lambda p, x: layer.apply(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    split = dataclasses.replace(layer, model_axis="model", expert_axis="expert" if "expert" in mesh_shape else None)
    rows = "expert" if "expert" in mesh_shape else None
    with cfx.Mesh(mesh_shape) as mesh:  # each expert's hidden units over model (12 -> 6 per rank)
        rules = {"mlp": "model", **({"experts": "expert"} if rows else {})}
        specs = cfx.Rules(rules).specs(layer.axes(), mesh=mesh)

        def body(p, x):
            local = dataclasses.replace(split, hidden=layer.hidden // 2)
            out = local.apply(p, x).pow(2).sum()
            return cfx.lax.psum(out, rows) if rows else out
        run = cfx.shard_map(body, mesh=mesh, in_specs=(specs, P(rows)), out_specs=P())
        got, grads = cfx.value_and_grad(run, argnums=(0, 1))(p, x)
    torch.testing.assert_close(cfx.device_get(got), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cfx.device_get(grads), want_grads, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, group_size", [(2, 6), (2, 3), (4, 3)])
def test_capacity_groups_over_an_expert_axis_equal_one_device(n, group_size):
    layer = cfx.nn.MoE(8, 12, 4, top_k=2, capacity_factor=0.75, group_size=group_size)
    p = f64(cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(5))))
    x = cfx.random.normal(cfx.random.key(6), (4, 3, 8)).double()  # 12 tokens: 12 / n per rank, whole groups

    def one(p, x):
        y, stats = layer.apply_with_stats(p, x)
        return y.pow(2).sum(), stats.dropped
    (want, want_dropped), want_grads = cfx.value_and_grad(one, argnums=(0, 1), has_aux=True)(p, x)
    assert float(want_dropped) > 0
    ep = dataclasses.replace(layer, expert_axis="expert")
    with cfx.Mesh({"expert": n}) as mesh:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(layer.axes(), mesh=mesh)

        def body(p, x):
            y, stats = ep.apply_with_stats(p, x)
            return cfx.lax.psum(y.pow(2).sum(), "expert"), cfx.lax.psum(stats.dropped, "expert")
        run = cfx.shard_map(body, mesh=mesh, in_specs=(specs, P("expert")), out_specs=(P(), P()))
        (got, dropped), grads = cfx.value_and_grad(run, argnums=(0, 1), has_aux=True)(p, x)
    assert float(cfx.device_get(dropped)) == float(want_dropped)
    torch.testing.assert_close(cfx.device_get(got), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cfx.device_get(grads), want_grads, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
def test_mixtral_in_capacity_mode_over_expert_and_data_axes_equals_one_device_with_its_groups():
    model = tiny(capacity_factor=0.5, capacity_group_size=8)  # 4 rows of 8: one group a row
    params = f64(model.init(cfx.random.key(0)))
    for block in params["blocks"]:
        block["mlp"]["router"] = block["mlp"]["router"] * 30  # no near ties in any token's top 2
    tokens = cfx.random.randint(cfx.random.key(1), (4, 8), 0, 64)
    targets = cfx.random.randint(cfx.random.key(2), (4, 8), 0, 64)
    want, want_grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
    want_dropped = [float(s.dropped) for s in model.router_stats(params, tokens)[1]]
    assert min(want_dropped) > 0
    ep = cfx.parallel.expert_parallel(model, stats_axes=("data", "expert"))
    with cfx.Mesh({"data": 2, "expert": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(model.axes(), mesh=mesh)
        rows = P(("data", "expert"))

        def body(p, x, y):
            loss = cfx.lax.pmean(ep.loss(p, x, y), ("data", "expert"))
            return loss, torch.stack([s.psum(("data", "expert")).dropped for s in ep.router_stats(p, x)[1]])
        run = cfx.shard_map(body, mesh=mesh, in_specs=(specs, rows, rows), out_specs=(P(), P()))
        (got, dropped), grads = cfx.value_and_grad(run, has_aux=True)(params, tokens, targets)
    assert cfx.device_get(dropped).tolist() == want_dropped
    torch.testing.assert_close(cfx.device_get(got), want, rtol=1e-6, atol=1e-6)  # fp32 cross-entropy, as above
    torch.testing.assert_close(cfx.device_get(grads), want_grads, rtol=1e-6, atol=1e-9)


def test_capacity_without_groups_is_refused_on_a_split_batch():
    with pytest.raises(ValueError, match="Mixtral: block 0's MoE\\(capacity_factor=1.0\\) has no group_size.*"
                                         "capacity_group_size=S"):
        cfx.parallel.expert_parallel(tiny(capacity_factor=1.0))
    layer = cfx.nn.MoE(8, 12, 4, capacity_factor=1.0, expert_axis="e")
    with cfx.Mesh({"e": 2}) as mesh:
        specs = cfx.Rules({"experts": "e"}).specs(layer.axes(), mesh=mesh)
        run = cfx.shard_map(lambda p, x: layer.apply(p, x), mesh=mesh, in_specs=(specs, P("e")), out_specs=P("e"))
        with pytest.raises(ValueError, match="batch is split over the expert axis.*set group_size="):
            run(layer.init(cfx.random.key(0)), torch.zeros(2, 4, 8))


def test_ragged_all_to_all_moves_rows_and_their_cotangents_back():
    sizes = torch.tensor([[1, 2, 0], [0, 1, 3], [2, 2, 1]])  # rank r sends sizes[r, d] rows to d
    x = torch.arange(3 * 5 * 2, dtype=torch.float64).reshape(3, 5, 2)  # each rank's rows (up to 5)

    def body(x, sizes):
        mine = x[0, :int(sizes[0].sum())]  # (rows, 2)
        got, came = cfx.lax.ragged_all_to_all(mine, "e", sizes[0])
        weight = torch.arange(1, got.shape[0] + 1, dtype=got.dtype)[:, None]
        return cfx.lax.psum((got * weight).sum(), "e"), torch.tensor(came)[None]

    with cfx.Mesh({"e": 3}) as mesh:
        run = cfx.shard_map(body, mesh=mesh, in_specs=(P("e"), P("e")), out_specs=(P(), P("e")))
        _, came = run(x, sizes)
        grads = cfx.grad(lambda x: run(x, sizes)[0])(x)
    assert torch.equal(cfx.device_get(came), sizes.T)  # rank d hears sizes[s, d] from each s
    # the cotangent of a row is the weight it met where it arrived: its place among that rank's rows
    want = torch.zeros_like(x)
    for s in range(3):
        start = 0
        for d in range(3):
            before = int(sizes[:s, d].sum())  # rows other senders put ahead of s's on rank d
            for i in range(int(sizes[s, d])):
                want[s, start + i] = before + i + 1
            start += int(sizes[s, d])
    torch.testing.assert_close(cfx.device_get(grads), want)


def test_bad_layouts_are_refused():
    with cfx.Mesh({"e": 2}) as mesh:
        bad_sizes = cfx.shard_map(lambda x: cfx.lax.ragged_all_to_all(x[0], "e", torch.tensor([1, 1]))[0][None],
                                  mesh=mesh, in_specs=P("e"), out_specs=P("e"))
        with pytest.raises(ValueError, match="add up to x's 3 rows"):
            bad_sizes(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="no mixture-of-experts blocks"):
        cfx.parallel.expert_parallel(cfx.models.llama("tiny", n_layer=1))
    layer = cfx.nn.MoE(8, 12, 3, expert_axis="e")
    with cfx.Mesh({"e": 2}) as mesh:
        run = cfx.shard_map(lambda p, x: layer.apply(p, x), mesh=mesh, in_specs=(P(), P("e")), out_specs=P("e"))
        with pytest.raises(ValueError, match="need E % n == 0"):
            run(layer.init(cfx.random.key(0)), torch.zeros(2, 4, 8))
