"""``cfx.autochunk``: the flow rules find the dims no op reduces over; chunked functions compute what
the unchunked ones do (hypothesis over attention-like programs and budgets, and the Evoformer);
the estimate tracks the measured peak and the measured peak meets the budget; a budget nothing
reaches is a ValueError naming the estimate; new shapes plan again."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.autochunk.api import _trace
from cfx._src.autochunk.estimate import items, simulate
from cfx._src.autochunk.flow import Chunk, flow
from cfx_tests.budget import examples


def measured_peak(fn, *args, **kwargs):
    with cfx.memory.track() as mem, mem.track_ops(tier="host"), torch.no_grad():
        out = fn(*args, **kwargs)
    return out, mem.peak("host")


def attention(x, wq, wk, wv, bias):
    """Attention over dim -2 of ``x`` (N, L, C) for every row N, with a shared (L, L) bias."""
    q, k, v = x @ wq, x @ wk, x @ wv
    a = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1)
    return torch.relu(a @ v).sum(-1)


def region_of(fn, args, output_index, dim):
    gm, _ = _trace(fn, args, {})
    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    out = order[-1].args[0][output_index]
    return flow(order, index, out, Chunk(dim)), gm


def test_a_region_follows_the_dims_no_op_reduces_over():
    x, w = torch.randn(4, 6, 5), torch.randn(5, 5)
    args = (x, w, w, w, torch.randn(6, 6))
    rows, _ = region_of(attention, args, 0, 0)  # rows of x: independent, the whole program chunks
    assert rows is not None and rows.n == 4
    assert {str(n.target) for n in rows.members} >= {"aten._softmax.default", "aten.bmm.default"}
    assert [c for node, c in rows.inputs if node.name.startswith("arg0")] == [Chunk(0)]  # x sliced by rows
    assert all(c is None for node, c in rows.inputs if not node.name.startswith("arg0"))  # weights, bias whole
    queries, _ = region_of(attention, args, 0, 1)  # queries: each softmax row is one query's
    assert queries is not None and "aten._softmax.default" in {str(n.target) for n in queries.members}
    # a sum over dim 0 keeps dim 1: its chunks come from x's columns, never from the summed rows
    total, _ = region_of(lambda x: (x * 2).sum(0), (torch.randn(6, 3),), 0, 0)
    assert [c for _, c in total.inputs] == [Chunk(1)]
    # a softmax over the chunked dim cannot be split: it stays whole, before the region
    norm, _ = region_of(lambda x: torch.softmax(x * 2, dim=0).exp(), (torch.randn(6, 3),), 0, 0)
    assert norm is not None and {str(n.target) for n in norm.members} == {"aten.exp.default"}


@examples(ci=6)
@given(data=st.data())
def test_chunked_programs_equal_unchunked_and_fit_their_budget(data):
    N, L, C = (data.draw(st.integers(2, 12), label=k) for k in "NLC")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    args = (torch.randn(N, L, C, generator=g), *(torch.randn(C, C, generator=g) for _ in range(3)),
            torch.randn(L, L, generator=g))
    full = cfx.autochunk(attention, args, memory_budget=1 << 40)
    unchunked = full.compile(*args).unchunked_bytes
    budget = int(unchunked * data.draw(st.sampled_from([0.9, 0.6, 0.4])))
    try:
        chunked = cfx.autochunk(attention, args, memory_budget=budget)
    except ValueError as e:
        assert "no chunking fits" in str(e)
        return
    plan = chunked.compile(*args)
    assert plan.chunked_bytes <= budget < plan.unchunked_bytes and plan.choices
    out, peak = measured_peak(chunked, *args)
    torch.testing.assert_close(out, attention(*args), rtol=1e-5, atol=1e-5)
    assert peak <= 1.25 * budget + 4096, (peak, budget)


@pytest.mark.timeout(300)
def test_the_evoformer_runs_in_half_its_activation_memory_and_computes_the_same():
    cfg = cfx.models.EvoformerConfig.preset("tiny", n_blocks=1, softmax_impl="reference")
    model = cfx.models.Evoformer(cfg)
    params = model.init(cfx.random.key(0))
    S, R = 8, 48
    g = torch.Generator().manual_seed(0)
    m, z = torch.randn(S, R, cfg.c_m, generator=g), torch.randn(R, R, cfg.c_z, generator=g)
    masks = dict(msa_mask=torch.rand(S, R, generator=g) > 0.2, pair_mask=torch.rand(R, R, generator=g) > 0.2)
    ref, ref_peak = measured_peak(model.apply, params, m, z, **masks)
    estimate = cfx.autochunk(model.apply, (params, m, z), memory_budget=1 << 40, kwargs=masks)
    unchunked = estimate.compile(params, m, z, **masks).unchunked_bytes
    assert 0.6 * ref_peak <= unchunked <= 1.1 * ref_peak  # the traced graph frees earlier than eager code
    chunked = cfx.autochunk(model.apply, (params, m, z), memory_budget=unchunked // 2, kwargs=masks)
    out, peak = measured_peak(chunked, params, m, z, **masks)
    cfx.tree.assert_tree_close(out, ref)
    assert peak <= 1.25 * unchunked // 2, (peak, unchunked)
    assert "chunks of" in chunked.report()


def test_a_budget_nothing_reaches_names_the_estimate_and_new_shapes_plan_again():
    args = (torch.randn(8, 6, 4), *(torch.randn(4, 4) for _ in range(3)), torch.randn(6, 6))
    with pytest.raises(ValueError, match="no chunking fits memory_budget=64 B: .* the estimated peak is"):
        cfx.autochunk(attention, args, memory_budget=64)
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        cfx.autochunk(attention, args, memory_budget=0)
    chunked = cfx.autochunk(attention, args, memory_budget="64KiB")
    bigger = (torch.randn(16, 6, 4), *args[1:])
    torch.testing.assert_close(chunked(*bigger), attention(*bigger))
    assert len(chunked._compiled) == 2


def test_the_estimate_is_the_graphs_own_peak():
    def f(x):
        y = x * 2          # 4 KiB
        z = y.exp()        # 4 KiB; y dies here
        return z.sum()
    gm, _ = _trace(f, (torch.randn(1024),), {})
    peak = simulate(items(list(gm.graph.nodes)))
    assert peak.bytes == 2 * 4096  # y and z at once, then the scalar


def test_one_blocks_plan_serves_every_block_of_a_stack():
    cfg = cfx.models.EvoformerConfig.preset("tiny", n_blocks=3, softmax_impl="reference")
    model = cfx.models.Evoformer(cfg)
    params = model.init(cfx.random.key(0))
    m, z = torch.randn(4, 32, cfg.c_m), torch.randn(32, 32, cfg.c_z)
    block = cfx.autochunk(lambda p, m, z: model.blocks[0].apply(p, (m, z)), (params["blocks"][0], m, z),
                          memory_budget="512KiB")
    x = (m, z)
    for p in params["blocks"]:
        x = block(p, *x)
    with torch.no_grad():
        cfx.tree.assert_tree_close(x, model.apply(params, m, z))
    assert len(block._compiled) == 1 and block.compile(params["blocks"][0], m, z).choices
