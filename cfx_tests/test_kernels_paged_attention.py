"""Paged attention: the Triton kernel (interpreted on CPU, native on CUDA) against the gather-then-attend
reference, and the reference against attention over each row's own contiguous keys in float64; the
serving engine with ``attention="triton"`` decodes what it decodes with the reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx_kernels.attention_reference import attention_reference
from cfx_kernels.paged_attention import paged_attention, paged_attention_reference, triton_unsupported
from cfx_tests.budget import examples


@pytest.fixture(scope="module")
def interpret():
    """Run Triton kernels through the interpreter (module scope: hypothesis forbids function scope)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def paged_inputs(lengths_before, news, H, Hkv, D, bs, *, dtype=torch.float32, seed=0):
    """Rows with ``lengths_before[b]`` cached tokens and ``news[b]`` new ones, their keys and values placed
    in a shuffled pool; also each row's contiguous keys and values (what the pool stands for)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(news), max(news)
    totals = [a + n for a, n in zip(lengths_before, news)]
    nb = max(-(-t // bs) for t in totals)
    NB = B * nb + 3
    order = torch.randperm(NB, generator=g)
    tables = order[:B * nb].reshape(B, nb)
    kp = torch.randn(NB, bs, Hkv, D, generator=g, dtype=torch.float64)
    vp = torch.randn(NB, bs, Hkv, D, generator=g, dtype=torch.float64)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = kp[tables.reshape(-1)].reshape(B, nb * bs, Hkv, D)
    v = vp[tables.reshape(-1)].reshape(B, nb * bs, Hkv, D)
    cast = lambda *xs: [x.to(dtype) for x in xs]  # noqa: E731
    return (*cast(q, kp, vp), tables, torch.tensor(lengths_before), torch.tensor(news)), (q, k, v, totals)


def per_row(q, k, v, starts, news, totals):
    """Each row alone: its real queries over its own first ``total`` keys, causally (float64)."""
    out = torch.zeros_like(q)
    for b, (a, n, t) in enumerate(zip(starts, news, totals)):
        out[b, :n] = attention_reference(q[b:b + 1, :n], k[b:b + 1, :t], v[b:b + 1, :t], causal=True)[0]
    return out


@examples(ci=4)
@given(rows=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=3),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), seed=st.integers(0, 99))
def test_the_reference_is_attention_over_each_rows_own_keys(rows, heads, seed):
    before, news = [r[0] for r in rows], [r[1] for r in rows]
    (q, kp, vp, tables, starts, lengths), (q64, k, v, totals) = paged_inputs(before, news, *heads, 8, 4,
                                                                                dtype=torch.float64, seed=seed)
    got = paged_attention_reference(q, kp, vp, tables, starts, lengths)
    torch.testing.assert_close(got, per_row(q64, k, v, before, news, totals), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(240)
@examples(ci=3)
@given(rows=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=3),
       heads=st.sampled_from([(2, 2), (4, 2)]), D=st.sampled_from([16, 24]), seed=st.integers(0, 99))
def test_the_kernel_equals_the_reference(interpret, rows, heads, D, seed):
    """Prefill (several new tokens, some rows with cached ones before) and decode (one), GQA, a head
    size that is not a power of two; fp32 within the fp32 reference's own rounding."""
    before, news = [r[0] for r in rows], [r[1] for r in rows]
    args, _ = paged_inputs(before, news, *heads, D, 16, seed=seed)
    got = paged_attention(*args, impl="triton")
    want = paged_attention_reference(*args)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)  # both fp32 sums of <= 60 terms of N(0,1)


def test_what_the_kernel_refuses(interpret):
    args, _ = paged_inputs([3], [2], 2, 2, 8, 4)
    assert "power-of-two size >= 16" in triton_unsupported(args[0], args[1])
    with pytest.raises(ValueError, match="power-of-two size >= 16"):
        paged_attention(*args, impl="triton")
    torch.testing.assert_close(paged_attention(*args, impl="auto"), paged_attention_reference(*args))  # CPU: reference
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        paged_attention(args[0], args[1][..., :1, :], args[2], *args[3:])


@pytest.mark.timeout(240)
def test_the_engine_decodes_through_the_kernel_as_through_the_reference(interpret, monkeypatch):
    """``attention="triton"`` (every layer's attention the kernel, under the interpreter) against the
    reference path on a workload with chunked prefill, decoding and preemption: the logits agree within
    fp32 rounding and the greedy tokens are the same."""
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_positions=128)
    params = model.init(cfx.random.key(0))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 21, 9)]
    sp = cfx.serve.SamplingParams(max_tokens=20, ignore_eos=True)
    from cfx._src.serve import paged
    calls, real = [], paged.paged_attention
    monkeypatch.setattr(paged, "paged_attention", lambda *a, **k: calls.append(k["impl"]) or real(*a, **k))
    outs = {}
    for impl in ("reference", "triton"):
        engine = cfx.serve.Engine(model, params, block_size=16, num_blocks=4, max_batch_tokens=16, max_seqs=3,
                                  attention=impl)
        outs[impl] = engine.generate(prompts, sp)
        assert engine.stats["preemptions"] > 0
    assert outs["triton"] == outs["reference"]
    assert calls and set(calls) == {"triton"}  # the kernel ran every attention of the triton engine, none before
