"""cfx.remat: every policy gives the no-remat values and gradients; what it keeps is what it says."""
import pytest
import torch

import cfx
from cfx import P
from cfx import checkpoint_policies as cp

POLICIES = {
    "everything": cp.everything_saveable,
    "nothing": cp.nothing_saveable,
    "dots": cp.dots_saveable,
    "only_names": cp.save_only_these_names("attn_out"),
    "all_names_but": cp.save_any_names_but_these("attn_out"),
    "offload": cp.offload_these_names("attn_out"),
    "callable": lambda s: "save" if s.nbytes > 10_000 else "recompute",
}


def gpt2(dropout=0.0):
    return cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=16, dropout=dropout)


def loss_and_grads(model, params, tokens, key=None):
    return cfx.value_and_grad(lambda p: model.loss(p, tokens[:, :-1], tokens[:, 1:], key=key))(params)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_matches_no_remat(name):
    model = gpt2(dropout=0.1)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (3, 17), 0, 64)
    key = cfx.random.key(2)  # dropout: the recomputed forward must replay the same masks
    ref_loss, ref_grads = loss_and_grads(model, params, tokens, key)
    rm = model.map_blocks(lambda b: cfx.remat(b, policy=POLICIES[name]))
    loss, grads = loss_and_grads(rm, params, tokens, key)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)


def test_nothing_saveable_keeps_only_the_input():
    block = gpt2().blocks[0]
    params = block.init(cfx.random.key(0))
    x = torch.randn(2, 8, 32, requires_grad=True)
    with cfx.activation_stats() as stats:
        y = cfx.remat(block.apply, policy=cp.nothing_saveable)(params, x)
    assert stats.bytes(tier="device") == 0 and stats.bytes(tier="host") == 0
    assert stats.bytes(tier="recomputed") > 0
    y.sum().backward()
    with cfx.activation_stats() as everything:
        cfx.remat(block.apply, policy=cp.everything_saveable)(params, x)
    assert everything.bytes(tier="device") == stats.bytes(tier="recomputed")


def test_backward_holds_one_recomputed_block_at_a_time():
    """A recomputed block's tensors are freed as its backward uses them: the backward peak of a
    remat'd stack grows with depth by the saved block inputs only (before the fix, every block's
    recomputed tensors stayed alive until backward ended: as much as no remat at all)."""
    def peak(n_layer: int, remat: bool) -> int:
        model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=n_layer, n_embd=64, n_head=4, n_positions=128)
        if remat:
            model = model.map_blocks(lambda b: cfx.remat(b))
        params = cfx.tree.map(lambda x: x.requires_grad_(), model.init(cfx.random.key(0)))
        tokens = cfx.random.randint(cfx.random.key(1), (4, 129), 0, 64)
        with cfx.memory.track() as mem, mem.track_ops():
            loss = model.loss(params, tokens[:, :-1], tokens[:, 1:])
            torch.autograd.grad(loss, cfx.tree.leaves(params))
        return mem.peak("device")
    block_input = 4 * 128 * 64 * 4  # (B, T, C) fp32
    deeper = peak(8, True) - peak(2, True)
    assert deeper <= 6 * 3 * block_input  # the 6 more blocks' inputs (and their grads in flight)
    assert deeper < (peak(8, False) - peak(2, False)) / 3


def test_dots_saveable_keeps_exactly_the_matmul_outputs():
    f = lambda w, x: torch.cos(torch.sin(x @ w)).sum()  # noqa: E731  sin saves x @ w, cos saves sin(.)
    w, x = torch.randn(4, 5, requires_grad=True), torch.randn(3, 4)
    with cfx.activation_stats() as stats:
        cfx.remat(f, policy=cp.dots_saveable)(w, x).backward()
    kept = [r for r in stats.records if r.tier == "device"]
    assert [r.shape for r in kept] == [(3, 5)]  # the matmul output only
    assert [r.tier for r in stats.records] == ["device", "recomputed"]


def test_offloaded_names_sit_on_host_and_values_are_unchanged():
    def f(w, x):
        h = cfx.checkpoint_name(x @ w, "h")
        return torch.sin(h).sum()
    w, x = torch.randn(4, 5, requires_grad=True), torch.randn(3, 4)
    policy = cp.offload_these_names("h")
    with cfx.activation_stats() as stats:
        out = cfx.remat(f, policy=policy)(w, x)
    host = [r for r in stats.records if r.tier == "host"]
    assert [r.name for r in host] == ["h"] and host[0].nbytes == 3 * 5 * 4
    (g,) = torch.autograd.grad(out, w)
    (ref,) = torch.autograd.grad(f(w, x), w)
    torch.testing.assert_close(g, ref)


def test_remat_inside_shard_map_on_a_tp_block_gives_the_same_gradients():
    model = gpt2()
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (4, 17), 0, 64)
    rules = cfx.Rules({"batch": "data", **cfx.parallel.MEGATRON_RULES})
    specs = rules.specs(model.axes())
    results = []
    for policy in (None, cp.nothing_saveable):
        tp = cfx.parallel.tensor_parallel(model, "model")
        if policy is not None:
            tp = tp.map_blocks(lambda b: cfx.remat(b, policy=policy))

        def grads(p, t, tp=tp):
            _, g = cfx.value_and_grad(lambda p: tp.loss(p, t[:, :-1], t[:, 1:]))(p)
            return cfx.parallel.tree_pmean(g, "data")
        with cfx.Mesh({"data": 2, "model": 2}) as mesh, cfx.comm_stats() as stats:
            results.append(cfx.device_get(cfx.shard_map(grads, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)(params, tokens)))
        results.append(stats.count(op="all_reduce", axes="model", rank=0))
    cfx.tree.assert_tree_close(results[2], results[0])
    assert results[3] > results[1]  # the recomputed forward re-issued its all-reduces


def test_bad_policy():
    with pytest.raises(ValueError, match="policy must be callable"):
        cfx.remat(lambda x: x, policy="nothing")
    with pytest.raises(ValueError, match="returned 'maybe'"):
        cfx.remat(lambda x: torch.sin(x * 2).sum(), policy=lambda s: "maybe")(torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("b,s,h,a", [(2, 64, 128, 4), (4, 128, 64, 2), (1, 256, 256, 8)])
def test_saved_bytes_of_a_gpt2_block_match_the_derived_textbook_count(b, s, h, a):
    """Korthikanti et al. (2022) count sbh(34 + 5as/h) bytes per block in fp16 with dropout and a
    materialised s x s attention matrix. This block, in fp32 (4 bytes), with no dropout and the
    CPU flash SDPA (which saves q, k, v, its output and a log-sum-exp instead of the scores):

      attention: QKV input 4sbh + q, k, v, out 16sbh + lse 4sba (o-proj reads SDPA's out: shared)
      MLP:       fc input 4sbh + GELU input 16sbh + proj input 16sbh
      norms:     LN2 input 4sbh + mean and rstd of both LNs 4 * 4sb   (LN1's input is the block's
                 input, which remat keeps as the checkpoint, so it is not counted here)

    = sbh (60 + 4a/h + 16/h) bytes.
    """
    block = cfx.models.gpt2("tiny", n_embd=h, n_head=a, n_positions=s).blocks[0]
    params = cfx.tree.map(lambda t: t.requires_grad_(), block.init(cfx.random.key(0)))
    x = torch.randn(b, s, h, requires_grad=True)
    with cfx.activation_stats() as stats:
        cfx.remat(block.apply, policy=cp.everything_saveable)(params, x)
    expected = s * b * h * (60 + 4 * a / h + 16 / h)
    assert abs(stats.bytes() - expected) <= 0.05 * expected


def test_dots_saveable_on_a_gpt2_block_keeps_the_matmul_outputs_seen_through_views():
    # Linear returns a view of its addmm output and attention splits q, k, v off the QKV matmul:
    # the saved views count as matmul outputs. Kept: q, k, v (3 x 4sbh) and the fc output (16sbh).
    b, s, h = 2, 16, 128
    block = cfx.models.gpt2("tiny", n_embd=h, n_head=4).blocks[0]
    params = cfx.tree.map(lambda t: t.requires_grad_(), block.init(cfx.random.key(0)))
    x = torch.randn(b, s, h, requires_grad=True)
    with cfx.activation_stats() as stats:
        cfx.remat(block.apply, policy=cp.dots_saveable)(params, x)
    assert stats.bytes(tier="device") == 4 * b * s * h * (3 + 4)
