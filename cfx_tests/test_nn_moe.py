"""cfx.nn.MoE: the sorted, grouped dispatch equals a plain loop over experts (outputs and gradients,
top-1 and top-2, fp32 through ``F.grouped_mm`` and fp64 through the padded batched matmul); the
capacity mode drops exactly the rows a token-order rule drops, within each group of ``group_size``
consecutive tokens where groups are set (one group: today's rule, bitwise); the router's statistics
and the auxiliary losses follow their formulas."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.nn.moe import grouped_matmul
from cfx_tests.budget import examples


def loop_reference(layer, p, x, capacity=None):
    """Every expert in a Python loop, as transformers' Mixtral runs them (and a capacity rule: an
    expert's rows beyond ``capacity`` in token order contribute nothing)."""
    flat = x.reshape(-1, layer.features)
    probs = torch.softmax((flat @ p["router"]).float(), -1)
    w, e = torch.topk(probs, layer.top_k, -1)
    w = w / w.sum(-1, keepdim=True) if layer.normalize else w
    y = torch.zeros_like(flat)
    for ex in range(layer.n_experts):
        tok, slot = torch.where(e == ex)  # in token order
        if capacity is not None:
            tok, slot = tok[:capacity], slot[:capacity]
        h = torch.nn.functional.silu(flat[tok] @ p["gate"][ex]) * (flat[tok] @ p["up"][ex])
        y = y.index_add(0, tok, (h @ p["down"][ex]) * w[tok, slot, None].to(flat.dtype))
    return y.view(x.shape)


@examples(ci=6)
@given(E=st.integers(1, 6), k=st.integers(1, 2), N=st.integers(1, 12), dtype=st.sampled_from(["f32", "f64"]),
       normalize=st.booleans(), seed=st.integers(0, 99))
def test_dispatch_equals_a_loop_over_experts(E, k, N, dtype, normalize, seed):
    k = min(k, E)
    dt = {"f32": torch.float32, "f64": torch.float64}[dtype]
    layer = cfx.nn.MoE(8, 12, E, top_k=k, normalize=normalize)
    p = cfx.tree.map(lambda t: (t * 20).to(dt), layer.init(cfx.random.key(seed)))
    x = cfx.random.normal(cfx.random.key(seed + 1), (1, N, 8)).to(dt)
    tol = dict(rtol=1e-5, atol=1e-6) if dt == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.apply(p, x), loop_reference(layer, p, x), **tol)
    grads = cfx.grad(lambda p, x: layer.apply(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    want = cfx.grad(lambda p, x: loop_reference(layer, p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    torch.testing.assert_close(grads, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_matmul_with_empty_groups(dtype):  # fp32: F.grouped_mm; fp64: the padded bmm
    x = torch.randn(9, 8, dtype=dtype)
    w = torch.randn(4, 8, 4, dtype=dtype)
    counts = torch.tensor([3, 0, 6, 0])
    want = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    torch.testing.assert_close(grouped_matmul(x, w, counts), want)


def test_capacity_mode_drops_the_rows_a_token_order_rule_drops():
    layer = cfx.nn.MoE(8, 12, 4, top_k=2, capacity_factor=0.75)
    p = cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(0)))
    x = cfx.random.normal(cfx.random.key(1), (2, 8, 8))
    y, stats = layer.apply_with_stats(p, x)
    capacity = math.ceil(0.75 * 16 * 2 / 4)  # 6 rows per expert
    torch.testing.assert_close(y, loop_reference(layer, p, x, capacity=capacity))
    assert stats.dropped == (stats.counts - capacity).clamp(min=0).sum() > 0
    torch.testing.assert_close(layer.apply(p, x), y)  # the same tokens every time


@pytest.mark.parametrize("group_size", [4, 6, 12, 24])
def test_capacity_groups_apply_the_token_order_rule_to_each_group(group_size):
    layer = cfx.nn.MoE(8, 12, 4, top_k=2, capacity_factor=0.75)
    grouped = dataclasses.replace(layer, group_size=group_size)
    p = cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(0)))
    x = cfx.random.normal(cfx.random.key(1), (4, 6, 8))  # 24 tokens: groups of 4 and 12 cut across rows
    capacity = math.ceil(0.75 * group_size * 2 / 4)

    def reference(p, x):  # each group of consecutive tokens on its own, as a loop over experts with its capacity
        flat = x.reshape(-1, 8)
        return torch.cat([loop_reference(layer, p, g, capacity=capacity) for g in flat.split(group_size)]).view(x.shape)
    y, stats = grouped.apply_with_stats(p, x)
    torch.testing.assert_close(y, reference(p, x))
    dropped = sum(float(layer.apply_with_stats(p, g)[1].dropped) for g in x.reshape(-1, 8).split(group_size))
    assert float(stats.dropped) == dropped > 0
    grads = cfx.grad(lambda p, x: grouped.apply(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    want = cfx.grad(lambda p, x: reference(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
    torch.testing.assert_close(grads, want)
    whole_y, whole = layer.apply_with_stats(p, x)
    if group_size == 24:  # one group: the rule without groups, bit for bit
        assert torch.equal(y, whole_y) and torch.equal(stats.dropped, whole.dropped)
    else:  # the groups decide other drops than one capacity over all the tokens
        assert not torch.equal(stats.dropped, whole.dropped)


def test_router_stats_and_auxiliary_losses_follow_their_formulas():
    layer = cfx.nn.MoE(8, 12, 4, top_k=2)
    p = layer.init(cfx.random.key(0))
    x = cfx.random.normal(cfx.random.key(1), (3, 5, 8))
    _, s = layer.apply_with_stats(p, x)
    logits = x.reshape(-1, 8) @ p["router"]
    probs = logits.softmax(-1)
    chosen = torch.nn.functional.one_hot(probs.topk(2, -1).indices, 4).sum(1).float()  # (N, E)
    torch.testing.assert_close(s.counts, chosen.sum(0))
    torch.testing.assert_close(s.probs, probs.sum(0))
    assert float(s.rows) == 15 and float(s.counts.sum()) == 30
    f, P = chosen.mean(0), probs.mean(0)
    torch.testing.assert_close(cfx.nn.load_balancing_loss(s), 4 * (f * P).sum())
    torch.testing.assert_close(cfx.nn.z_loss(s), torch.logsumexp(logits, -1).pow(2).mean())
    two = s + s  # summed over two layers: the same fractions
    torch.testing.assert_close(cfx.nn.load_balancing_loss(two), cfx.nn.load_balancing_loss(s))


@pytest.mark.parametrize("capacity", [None, 0.75])
def test_router_stats_per_group_are_each_groups_own(capacity):
    layer = cfx.nn.MoE(8, 12, 4, top_k=2, capacity_factor=capacity, group_size=capacity and 4)
    p = cfx.tree.map(lambda t: t * 20, layer.init(cfx.random.key(0)))
    x = cfx.random.normal(cfx.random.key(1), (2, 6, 8))  # 12 tokens: 3 groups of 4, cutting across rows
    y, s = layer.apply_with_stats(p, x, stats_group_size=4)
    assert torch.equal(y, layer.apply(p, x)) and s.counts.shape == (3, 4) and s.rows.tolist() == [4.0] * 3
    for g, part in enumerate(x.reshape(-1, 8).split(4)):  # a group's statistics: the layer's on it alone
        want = layer.apply_with_stats(p, part)[1]
        for got, w in zip(s, want):
            torch.testing.assert_close(got[g], w)
        torch.testing.assert_close(cfx.nn.load_balancing_loss(s)[g], cfx.nn.load_balancing_loss(want))
        torch.testing.assert_close(cfx.nn.z_loss(s)[g], cfx.nn.z_loss(want))
    with pytest.raises(ValueError, match=r"stats_group_size=5\): this call's 12 tokens .* whole groups of 5"):
        layer.apply_with_stats(p, x, stats_group_size=5)


def test_bad_configuration_and_input_are_refused():
    with pytest.raises(ValueError, match="top_k must be in"):
        cfx.nn.MoE(8, 12, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        cfx.nn.MoE(8, 12, 2, capacity_factor=0)
    with pytest.raises(ValueError, match="group_size must be a positive number of tokens"):
        cfx.nn.MoE(8, 12, 2, capacity_factor=1.0, group_size=0)
    with pytest.raises(ValueError, match=r"MoE\(group_size=4\).*pass capacity_factor= as well"):
        cfx.nn.MoE(8, 12, 2, group_size=4)
    layer = cfx.nn.MoE(8, 12, 2)
    with pytest.raises(ValueError, match="expected features=8"):
        layer.apply(layer.init(cfx.random.key(0)), torch.zeros(2, 7))
    grouped = cfx.nn.MoE(8, 12, 2, capacity_factor=1.0, group_size=4)
    with pytest.raises(ValueError, match=r"this call's 6 tokens \(x shape \(2, 3, 8\)\) do not form whole groups of 4"):
        grouped.apply(grouped.init(cfx.random.key(0)), torch.zeros(2, 3, 8))
