"""cfx_kernels.adamw: the flat-buffer AdamW step (Triton, interpreted on CPU) against the
reference, the reference against torch.optim.AdamW step for step, and cfx.optim.adamw over a
pytree flattened into one chunk."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cfx
from cfx_kernels.adamw import adamw_flat_
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("interpret")


def run_steps(impl, p0, grads, **hp):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    out = []
    for step, g in enumerate(grads, start=1):
        adamw_flat_(p, g, m, v, step=step, impl=impl, **hp)
        out.append((p.clone(), m.clone(), v.clone()))
    return out


hyper = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 3e-2]), "b1": st.sampled_from([0.9, 0.5]),
    "b2": st.sampled_from([0.999, 0.95]), "eps": st.sampled_from([1e-8, 1e-6]),
    "weight_decay": st.sampled_from([0.0, 0.1])})


@settings(max_examples=10)
@given(n=st.integers(1, 3000), grad_dtype=st.sampled_from([torch.float32, torch.float16,
                                                             torch.bfloat16]),
       steps=st.integers(1, 4), hp=hyper, seed=st.integers(0, 2**16))
def test_kernel_matches_reference(n, grad_dtype, steps, hp, seed):
    p0 = randn(n, seed=seed)
    grads = [randn(n, seed=seed + 1 + s).to(grad_dtype) for s in range(steps)]
    got = run_steps("triton", p0, grads, **hp)
    want = run_steps("reference", p0, grads, **hp)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for name, a, b in zip(["param", "exp_avg", "exp_avg_sq"], g, w):
            assert_close(a, b, torch.float32, f"step {step} {name}")  # fp32 buffers


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_matches_torch_adamw_step_for_step(impl):
    p0 = randn(777, seed=0)
    grads = [randn(777, seed=s + 1) for s in range(5)]
    hp = dict(lr=1e-2, b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.05)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    got = run_steps(impl, p0, grads, **hp)
    for (p, m, v), g in zip(got, grads):
        ref.grad = g.clone()
        opt.step()
        state = opt.state[ref]
        if impl == "reference":  # the same ops in the same order: bit for bit
            assert torch.equal(p, ref.detach())
            assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
        else:
            torch.testing.assert_close(p, ref.detach(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(v, state["exp_avg_sq"], atol=1e-7, rtol=1e-5)


def test_flat_chunk_equals_cfx_optim_adamw_over_the_tree():
    # Gemini-style: the leaves of a pytree laid end to end in one fp32 chunk
    params = {"w": randn(6, 5, seed=0), "b": randn(5, seed=1), "blocks": [randn(3, 4, seed=2)]}
    leaves, treedef = cfx.tree.flatten(params)
    flat = torch.cat([x.reshape(-1) for x in leaves])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    tx = cfx.optim.adamw(3e-2, weight_decay=0.1)
    state = tx.init(params)
    for step in range(1, 4):
        grads = cfx.tree.map(lambda x: randn(*x.shape, seed=step * 100 + x.numel()), params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        g = torch.cat([x.reshape(-1) for x in cfx.tree.leaves(grads)])
        adamw_flat_(flat, g, m, v, step=step, lr=3e-2, weight_decay=0.1, impl="triton")
        sizes = [x.numel() for x in leaves]
        unflat = cfx.tree.unflatten(treedef, [c.view(x.shape) for c, x in
                                              zip(flat.split(sizes), leaves)])
        cfx.tree.assert_tree_close(unflat, params, atol=1e-6, rtol=1e-5)


def test_bad_input_names_the_argument():
    p, g = randn(10, seed=0), randn(10, seed=1)
    m, v = torch.zeros(10), torch.zeros(10)
    kw = dict(step=1, lr=1e-3, impl="triton")
    with pytest.raises(ValueError, match="grad has 9 elements"):
        adamw_flat_(p, g[:9], m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg must be a 1-D contiguous"):
        adamw_flat_(p, g, torch.zeros(20)[::2], v, **kw)
    with pytest.raises(ValueError, match="param must be float32"):
        adamw_flat_(p.half(), g, m, v, **kw)
    with pytest.raises(ValueError, match="grad must be one of"):
        adamw_flat_(p, g.double(), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq must be a 1-D"):
        adamw_flat_(p, g, m, v.view(2, 5), **kw)
    with pytest.raises(ValueError, match="step must be"):
        adamw_flat_(p, g, m, v, step=0, lr=1e-3)


@pytest.mark.gpu
def test_kernel_on_gpu_at_real_size(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    n = 64 * 2**20 + 3
    p0 = randn(n, seed=0, device="cuda")
    grads = [randn(n, seed=s, device="cuda").bfloat16() for s in range(1, 4)]
    got = run_steps("triton", p0, grads, lr=1e-3, weight_decay=0.1)
    want = run_steps("reference", p0, grads, lr=1e-3, weight_decay=0.1)
    for g, w in zip(got[-1], want[-1]):
        assert_close(g, w, torch.float32)


def test_optim_adamw_routes_flat_chunks_to_the_kernel(interpret):
    from cfx import optim
    chunks = {"c0": randn(300, seed=1), "c1": randn(77, seed=2)}
    mask = {"c0": True, "c1": False}
    fused = optim.adamw(1e-2, weight_decay=0.1, mask=mask, impl="triton")
    plain = optim.adamw(1e-2, weight_decay=0.1, mask=mask, impl="reference")
    p1 = p2 = chunks
    s1, s2 = fused.init(p1), plain.init(p2)
    for step in range(4):
        g = {k: randn(v.numel(), seed=10 * step + i) for i, (k, v) in enumerate(chunks.items())}
        before = {k: v.clone() for k, v in p1.items()}
        u1, s1 = fused.update(g, s1, p1)
        u2, s2 = plain.update(g, s2, p2)
        assert all(torch.equal(p1[k], before[k]) for k in p1)  # inputs untouched
        p1, p2 = optim.apply_updates(p1, u1), optim.apply_updates(p2, u2)
        for k in chunks:
            torch.testing.assert_close(p1[k], p2[k], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(s1[0].mu[k], s2[0].mu[k])
