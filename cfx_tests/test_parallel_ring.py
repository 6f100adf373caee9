"""Ring self-attention over a ``seq`` axis equals single-device attention (outputs and q/k/v
gradients): causal (zigzag and contiguous layouts) and bidirectional with padding, GQA, on
2 and 4 ranks; each step's collectives are the ring's."""
import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx._src.parallel.ring import ring_attention, zigzag_indices


def reference(q, k, v, w, causal, mask):
    """Single device: the attention output and the gradients of sum(out * w)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = cfx.nn.attention(q, k, v, causal=causal, mask=mask, impl="reference")
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


def ring(q, k, v, w, causal, mask, n, layout):
    T = q.shape[1]
    idx = zigzag_indices(T, n) if layout == "zigzag" else torch.arange(T)
    perm = lambda t: None if t is None else t[:, idx]  # noqa: E731

    def body(q, k, v, w, m):
        def f(q, k, v):
            out = ring_attention(q, k, v, "seq", causal=causal, mask=None if mask is None else m, layout=layout,
                                 impl="reference")
            return (out * w).sum(), out
        (_, out), grads = cfx.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)
    spec = P(None, "seq")
    m = torch.ones(q.shape[:2], dtype=torch.bool) if mask is None else mask
    with cfx.Mesh({"seq": n}) as mesh:
        got = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)(
            perm(q), perm(k), perm(v), perm(w), perm(m)))
    inv = torch.argsort(idx)
    return [t[:, inv] for t in got]


@pytest.mark.timeout(120)
@given(n=st.sampled_from([2, 4]), causal=st.booleans(), layout=st.sampled_from(["zigzag", "contiguous"]),
       kv_heads=st.sampled_from([1, 2, 4]), padded=st.booleans(), chunk=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_ring_equals_single_device_attention(n, causal, layout, kv_heads, padded, chunk, seed):
    B, H, D = 2, 4, 8
    T = 2 * n * chunk
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, T, kv_heads, D, generator=g), torch.randn(B, T, kv_heads, D, generator=g)
    mask = None
    if padded:  # row 1 has its last positions padded
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, T // 2 + 1:] = False
    want = reference(q, k, v, w, causal, mask)
    got = ring(q, k, v, w, causal, mask, n, layout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(60)
def test_each_step_sends_one_block_round_the_ring():
    # forward: N-1 hops of the stacked k/v (and of the padding mask); backward: N-1 of k/v and N
    # of their gradient accumulators, the last one home
    n, B, T, H, D = 4, 2, 16, 2, 8
    x = torch.randn(B, T, H, D)
    with cfx.Mesh({"seq": n}) as mesh, cfx.comm_stats() as stats:
        def body(q, m):
            out, g = cfx.value_and_grad(lambda q: ring_attention(q, q, q, "seq", mask=m).sum())(q)
            return g
        cfx.shard_map(body, mesh=mesh, in_specs=(P(None, "seq"), P(None, "seq")), out_specs=P(None, "seq"))(
            x, torch.ones(B, T, dtype=torch.bool))
    perms = [r for r in stats.records if r.op == "ppermute" and r.rank == 0]
    block = B * (T // n) * H * D
    assert sorted(r.numel for r in perms) == sorted([2 * block] * (2 * (n - 1) + n) + [B * T // n] * (2 * (n - 1)))


def test_bad_inputs_are_refused_before_any_collective():
    x = torch.randn(1, 6, 2, 4)
    with cfx.Mesh({"seq": 2}) as mesh:
        def call(**kw):
            return cfx.shard_map(lambda q: ring_attention(q, q, q, "seq", **kw), mesh=mesh, in_specs=P(None, "seq"),
                                 out_specs=P(None, "seq"))(x)
        with pytest.raises(ValueError, match="two equal chunks, but this rank holds 3 positions"):
            call()
        with pytest.raises(ValueError, match="layout must be one of"):
            call(layout="striped")
        with pytest.raises(ValueError, match="unknown mesh axis|not an axis|'sequence'"):
            cfx.shard_map(lambda q: ring_attention(q, q, q, "sequence"), mesh=mesh, in_specs=P(None, "seq"),
                          out_specs=P(None, "seq"))(x)
    with pytest.raises(ValueError, match="does not split into 2 x 4"):
        zigzag_indices(12, 4)
