"""DP x TP (Megatron rules) training equals the single-device run; the communication matches Megatron."""
import pytest
import torch

import cfx
from cfx import P
from cfx.parallel import MEGATRON_RULES, state_specs, tensor_parallel, tree_pmean, tree_psum

pytestmark = pytest.mark.timeout(300)

STEPS, B, T = 5, 4, 16


def models():
    return {
        "gpt2": cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=T),
        "llama": cfx.models.llama("tiny", vocab_size=64, n_layer=2, hidden_size=32, n_head=4, n_kv_heads=2,
                                  intermediate_size=48, max_position_embeddings=T),
    }


def data():
    return cfx.random.randint(cfx.random.key(7), (STEPS, B, T + 1), 0, 64)


def single_device(model, tx):
    params = model.init(cfx.random.key(0))
    state, losses = tx.init(params), []
    for t in data():
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        losses.append(loss)
    return torch.stack(losses), params


def dp_tp(model, tx, mesh):
    params = model.init(cfx.random.key(0))
    rules = cfx.Rules({"batch": "data", **MEGATRON_RULES})
    pspecs = rules.specs(model.axes(), mesh=mesh)
    state = tx.init(params)
    sspecs = state_specs(state, params, pspecs)
    tp_model = tensor_parallel(model, "model")

    def step(params, state, batch):  # per rank: its batch shard, its TP shard of the params
        loss, grads = cfx.value_and_grad(lambda p: tp_model.loss(p, batch[:, :-1], batch[:, 1:]))(params)
        grads = tree_pmean(grads, "data")
        updates, state = tx.update(grads, state, params)
        return cfx.optim.apply_updates(params, updates), state, cfx.lax.pmean(loss, "data")

    train_step = cfx.shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, rules.spec(("batch",))),
                               out_specs=(pspecs, sspecs, P()), check_rep=True)
    losses = []
    for t in data():
        params, state, loss = train_step(params, state, t)  # ShardedArrays: they stay sharded
        losses.append(cfx.device_get(loss))
    return torch.stack(losses), cfx.device_get(params)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_dp_tp_training_equals_single_device(name):
    model = models()[name]
    # SGD with momentum: linear in the gradients. (Adam turns float noise in gradients that are
    # zero in exact arithmetic, e.g. the key bias's, into lr-sized steps of either sign.)
    tx = cfx.optim.sgd(0.3, momentum=0.9, weight_decay=1e-4)
    ref_losses, ref_params = single_device(model, tx)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        losses, params = dp_tp(model, tx, mesh)
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


def test_tp_block_issues_megatrons_two_all_reduces_each_way():
    model = models()["gpt2"]
    c = model.config
    params = model.init(cfx.random.key(0))
    rules = cfx.Rules(MEGATRON_RULES)
    block = tensor_parallel(model, "model").blocks[0]
    x = torch.randn(B, T, c.n_embd)

    def body(p, x):
        _, g = cfx.value_and_grad(lambda p, x: block.apply(p, x).pow(2).mean(), argnums=(0, 1))(p, x)
        return g[1]
    with cfx.Mesh({"model": 2}) as mesh, cfx.comm_stats() as stats:
        gx = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(rules.specs(model.axes()["blocks"][0]), P()),
                           out_specs=P())(params["blocks"][0], x))
    for backward in (False, True):
        recs = stats.select(rank=0, backward=backward)
        assert [r.op for r in recs] == ["all_reduce", "all_reduce"]
        assert all(r.numel == B * T * c.n_embd for r in recs)  # b*s*h elements each
    ref = cfx.grad(lambda x: model.blocks[0].apply(params["blocks"][0], x).pow(2).mean())(x)
    torch.testing.assert_close(gx, ref)


def test_dp_gradient_sync_is_one_all_reduce_of_all_params():
    model = models()["gpt2"]
    params = model.init(cfx.random.key(0))
    n_params = cfx.tree.tree_size(params)
    with cfx.Mesh({"data": 4}) as mesh, cfx.comm_stats() as stats:
        cfx.device_get(cfx.shard_map(lambda p: tree_pmean(p, "data"), mesh=mesh, in_specs=P(), out_specs=P())(params))
    recs = stats.select(rank=0)
    assert len(recs) == 1 and recs[0].op == "all_reduce" and recs[0].nbytes == 4 * n_params
    # ring all-reduce moves 2 (N-1)/N of the payload per rank: 2 * Psi * (N-1)/N
    assert 2 * recs[0].nbytes * 3 / 4 == 2 * 4 * n_params * (4 - 1) / 4


def test_the_flat_all_reduce_keeps_fp64_leaves_fp64():
    tree = {"a": torch.tensor([1.0 + 2 ** -40], dtype=torch.float64), "b": torch.ones(2)}
    with cfx.Mesh({"data": 2}) as mesh:
        got = cfx.device_get(cfx.shard_map(lambda t: tree_psum(t, "data"), mesh=mesh, in_specs=P(), out_specs=P())(tree))
    assert got["a"].dtype == torch.float64 and got["a"].item() == 2 * (1.0 + 2 ** -40)  # fp32 would round it
    assert got["b"].dtype == torch.float32 and torch.equal(got["b"], torch.full((2,), 2.0))


def test_tp_bad_mesh_size():
    model = models()["llama"]  # 2 kv heads
    params = model.init(cfx.random.key(0))
    with cfx.Mesh({"model": 4}) as mesh:
        rules = cfx.Rules(MEGATRON_RULES)
        f = cfx.shard_map(lambda p, t: tensor_parallel(model).loss(p, t, t), mesh=mesh,
                          in_specs=(rules.specs(model.axes()), P()), out_specs=P())
        with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by 4"):
            f(params, torch.zeros(2, 4, dtype=torch.long))


def test_vocab_parallel_logits_are_shards_of_the_full_logits():
    model = models()["llama"]
    params = model.init(cfx.random.key(3))
    tokens = cfx.random.randint(cfx.random.key(4), (2, T), 0, 64)
    rules = cfx.Rules(MEGATRON_RULES)
    with cfx.Mesh({"model": 2}) as mesh:
        logits = cfx.device_get(cfx.shard_map(lambda p, t: tensor_parallel(model).apply(p, t), mesh=mesh,
                               in_specs=(rules.specs(model.axes()), P()), out_specs=P(None, None, "model"))(params, tokens))
    torch.testing.assert_close(logits, model.apply(params, tokens))


def test_vocab_not_divisible_names_the_leaf():
    model = cfx.models.gpt2("tiny", vocab_size=65, n_layer=1, n_embd=32, n_head=4, n_positions=T)
    params = model.init(cfx.random.key(0))
    rules = cfx.Rules(MEGATRON_RULES)
    with cfx.Mesh({"model": 2}) as mesh:
        f = cfx.shard_map(lambda p, t: tensor_parallel(model).loss(p, t, t), mesh=mesh,
                          in_specs=(rules.specs(model.axes()), P()), out_specs=P())
        with pytest.raises(ValueError, match=r"'args\[0\]\.wte\.w'.*size 65, not divisible by 2"):
            f(params, torch.zeros(2, 4, dtype=torch.long))
