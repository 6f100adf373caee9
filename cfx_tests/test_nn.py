"""cfx.nn layers against textbook math written out here."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import cfx
from cfx import nn

KEY = cfx.random.key(0)


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def perturbed(params, seed=1, std=0.5):
    """Params with every leaf moved off its init (so norm scales/biases are not 1/0)."""
    items, treedef = cfx.tree.flatten_with_path(params)
    leaves = [x.double() + std * randn(*x.shape, seed=seed + i) for i, (_, x) in enumerate(items)]
    return cfx.tree.unflatten(treedef, leaves)


def is_axes_leaf(x):
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


# ---------------------------------------------------------------- reference attention


def naive_attention(q, k, v, *, causal, mask=None, scale=None):
    """softmax(q k^T * scale + bias) v per (batch, head), one loop at a time; q (B,T,H,D)."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            s = q[b, :, h] @ k[b, :, kh].T * scale  # (T, S)
            allowed = torch.ones(T, S, dtype=torch.bool)
            if causal:
                for i in range(T):
                    for j in range(S):
                        allowed[i, j] = j <= i + S - T
            if mask is not None:
                allowed &= mask[b][None, :] if mask.dim() == 2 else mask[b]
            for i in range(T):
                if allowed[i].any():
                    p = torch.softmax(s[i].masked_fill(~allowed[i], float("-inf")), dim=-1)
                    out[b, i, h] = p @ v[b, :, kh]
    return out


@st.composite
def attention_case(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from([2, 4, 8]))
    T = draw(st.integers(1, 6))
    S = draw(st.sampled_from([T, T + draw(st.integers(1, 3))]))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "padding", "full"]))
    seed = draw(st.integers(0, 1000))
    return B, T, S, H, Hkv, D, causal, mask_kind, seed


@given(attention_case(), st.sampled_from([None, 0.3]))
def test_attention_matches_naive_softmax(case, scale):
    B, T, S, H, Hkv, D, causal, mask_kind, seed = case
    q = randn(B, T, H, D, seed=seed)
    k, v = randn(B, S, Hkv, D, seed=seed + 1), randn(B, S, Hkv, D, seed=seed + 2)
    g = torch.Generator().manual_seed(seed)
    mask = None
    if mask_kind == "padding":
        mask = torch.rand(B, S, generator=g) < 0.7
    elif mask_kind == "full":
        mask = torch.rand(B, T, S, generator=g) < 0.7
    out = nn.attention(q, k, v, causal=causal, mask=mask, scale=scale)
    assert out.shape == (B, T, H, D)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=causal, mask=mask, scale=scale))


def test_attention_gradients_match_naive_and_fully_masked_rows_are_zero():
    q, k, v = randn(2, 5, 4, 4, seed=3), randn(2, 5, 2, 4, seed=4), randn(2, 5, 2, 4, seed=5)
    # Left padding: in batch 0 the first two queries see no key at all under the causal mask.
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = nn.attention(*ins, causal=True, mask=mask)
    assert torch.isfinite(out).all()
    assert (out[0, :2] == 0).all()
    ref_ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive_attention(*ref_ins, causal=True, mask=mask)
    torch.testing.assert_close(out, ref)
    w = randn(*out.shape, seed=6)
    grads = torch.autograd.grad((out * w).sum(), ins)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_ins)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("q_shape,kv_shape,mask,match", [
    ((1, 4, 3, 8), (1, 4, 2, 8), None, "multiple"),
    ((1, 4, 4, 8), (1, 4, 2, 4), None, "head_dim"),
    ((1, 4, 4), (1, 4, 2, 4), None, "q must be 4-D"),
    ((1, 4, 4, 8), (1, 4, 2, 8), torch.ones(1, 5, dtype=torch.bool), "mask must have shape"),
    ((1, 4, 4, 8), (1, 4, 2, 8), torch.ones(1, 4), "bool"),
])
def test_attention_rejects_bad_inputs(q_shape, kv_shape, mask, match):
    with pytest.raises(ValueError, match=match):
        nn.attention(torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape), mask=mask)


# ---------------------------------------------------------------- rope


@given(st.integers(1, 3).map(lambda h: 2 * h), st.integers(1, 7), st.integers(0, 100))
def test_rope_rotates_pairs_i_and_i_plus_half(half2, T, seed):
    D = 2 * half2
    x = randn(1, T, 2, D, seed=seed)
    pos = torch.arange(T)
    cos, sin = nn.rope_cos_sin(pos, D, theta=100.0, dtype=torch.float64)
    out = nn.apply_rope(x, cos, sin)
    ref = torch.empty_like(x)
    for t in range(T):
        for i in range(D // 2):
            ang = t * 100.0 ** (-2 * i / D)
            a, b = x[:, t, :, i], x[:, t, :, i + D // 2]
            ref[:, t, :, i] = a * math.cos(ang) - b * math.sin(ang)
            ref[:, t, :, i + D // 2] = b * math.cos(ang) + a * math.sin(ang)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # angles are computed in fp32


def test_rope_scores_depend_only_on_relative_position():
    D = 8
    q, k = randn(D, seed=1), randn(D, seed=2)
    pos = torch.arange(12)
    cos, sin = nn.rope_cos_sin(pos, D, dtype=torch.float64)

    def score(m, n):
        qm = nn.apply_rope(q.view(1, 1, 1, D), cos[m:m + 1], sin[m:m + 1])
        kn = nn.apply_rope(k.view(1, 1, 1, D), cos[n:n + 1], sin[n:n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(5, 2), score(10, 7), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3))


# ---------------------------------------------------------------- simple layers


@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_x_at_w_plus_b(bias):
    lin = nn.Linear(5, 3, bias=bias)
    p = perturbed(lin.init(KEY))
    x = randn(2, 4, 5)
    ref = x @ p["w"] + (p["b"] if bias else 0)
    torch.testing.assert_close(lin.apply(p, x), ref)
    assert p["w"].shape == (5, 3)


def test_embedding_lookup_and_tied_head():
    emb = nn.Embedding(11, 4)
    p = emb.init(KEY)
    ids = torch.tensor([[0, 3, 10], [7, 7, 1]])
    torch.testing.assert_close(emb.apply(p, ids), p["w"][ids])
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(emb.attend(p, x), torch.einsum("btc,vc->btv", x, p["w"]))
    with pytest.raises(ValueError, match="integer"):
        emb.apply(p, ids.float())


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_formula(bias):
    ln = nn.LayerNorm(6, eps=1e-3, bias=bias)
    p = perturbed(ln.init(KEY))
    x = randn(3, 6, seed=2) * 3 + 1
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    ref = (x - mu) / torch.sqrt(var + 1e-3) * p["scale"] + (p["bias"] if bias else 0)
    torch.testing.assert_close(ln.apply(p, x), ref)
    torch.testing.assert_close(ln.apply(p, x), F.layer_norm(x, (6,), p["scale"], p.get("bias"), 1e-3))


def test_rmsnorm_matches_formula():
    rms = nn.RMSNorm(6, eps=1e-2)
    p = perturbed(rms.init(KEY))
    x = randn(3, 6, seed=2) * 3 + 1
    ref = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-2) * p["scale"]
    # The statistic is taken in fp32 (as HF Llama does), so compare at fp32 precision.
    torch.testing.assert_close(rms.apply(p, x), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="features"):
        rms.apply(p, randn(3, 5))


def test_dropout_masks_scale_and_keys():
    x = torch.ones(200, 100)
    d = nn.Dropout(0.3)
    k1, k2 = cfx.random.split(KEY)
    a, b, c = d.apply({}, x, key=k1), d.apply({}, x, key=k1), d.apply({}, x, key=k2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.testing.assert_close(a.unique(), torch.tensor([0.0, 1 / 0.7]))
    assert abs((a == 0).float().mean().item() - 0.3) < 0.02
    assert abs(a.mean().item() - 1.0) < 0.05  # expectation preserved
    assert torch.equal(d.apply({}, x), x)
    assert torch.equal(nn.Dropout(0.0).apply({}, x, key=k1), x)
    with pytest.raises(ValueError, match="rate"):
        nn.Dropout(1.0)


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "relu", "swiglu"])
def test_mlp_matches_manual(act):
    mlp = nn.MLP(4, 7, activation=act, bias=act != "swiglu")
    p = perturbed(mlp.init(KEY))
    x = randn(2, 3, 4, seed=9)
    if act == "swiglu":
        ref = (F.silu(x @ p["gate"]["w"]) * (x @ p["up"]["w"])) @ p["down"]["w"]
    else:
        h = x @ p["fc"]["w"] + p["fc"]["b"]
        h = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu, "relu": F.relu}[act](h)
        ref = h @ p["proj"]["w"] + p["proj"]["b"]
    torch.testing.assert_close(mlp.apply(p, x), ref)


def test_attention_layer_matches_manual_composition():
    layer = nn.Attention(16, 4, n_kv_heads=2, bias=True, rope=True, rope_theta=50.0)
    p = perturbed(layer.init(KEY))
    B, T, H, Hkv, D = 2, 5, 4, 2, 4
    x = randn(B, T, 16, seed=4)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    q = (x @ p["q"]["w"] + p["q"]["b"]).view(B, T, H, D)
    k = (x @ p["k"]["w"] + p["k"]["b"]).view(B, T, Hkv, D)
    v = (x @ p["v"]["w"] + p["v"]["b"]).view(B, T, Hkv, D)
    cos, sin = nn.rope_cos_sin(torch.arange(T), D, theta=50.0, dtype=torch.float64)
    q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    ref = naive_attention(q, k, v, causal=True, mask=mask).reshape(B, T, H * D) @ p["o"]["w"] + p["o"]["b"]
    torch.testing.assert_close(layer.apply(p, x, mask=mask), ref)
    with pytest.raises(ValueError, match="n_kv_heads"):
        nn.Attention(12, 4, n_kv_heads=3)


@pytest.mark.parametrize("norm,act", [("layernorm", "gelu_tanh"), ("rmsnorm", "swiglu")])
def test_block_is_prenorm_residual(norm, act):
    blk = nn.TransformerBlock(8, 2, 12, norm=norm, activation=act, bias=norm == "layernorm")
    p = perturbed(blk.init(KEY))
    x = randn(2, 4, 8, seed=3)
    n1 = nn.LayerNorm(8, eps=1e-5) if norm == "layernorm" else nn.RMSNorm(8, eps=1e-5)
    attn = nn.Attention(8, 2, bias=norm == "layernorm")
    mlp = nn.MLP(8, 12, activation=act, bias=norm == "layernorm")
    h = x + attn.apply(p["attn"], n1.apply(p["norm1"], x))
    ref = h + mlp.apply(p["mlp"], n1.apply(p["norm2"], h))
    torch.testing.assert_close(blk.apply(p, x), ref, rtol=1e-6, atol=1e-6)


def test_block_dropout_uses_key_only():
    blk = nn.TransformerBlock(8, 2, 12, dropout=0.5)
    p = blk.init(KEY)
    x = randn(2, 4, 8, dtype=torch.float32)
    k1, k2 = cfx.random.split(KEY)
    no_drop = nn.TransformerBlock(8, 2, 12).apply(p, x)
    assert torch.equal(blk.apply(p, x), no_drop)
    assert torch.equal(blk.apply(p, x, key=k1), blk.apply(p, x, key=k1))
    assert not torch.allclose(blk.apply(p, x, key=k1), blk.apply(p, x, key=k2))
    assert not torch.allclose(blk.apply(p, x, key=k1), no_drop)


LAYERS = [
    nn.Linear(3, 5), nn.Linear(3, 5, bias=False), nn.Embedding(7, 3), nn.LayerNorm(3),
    nn.LayerNorm(3, bias=False), nn.RMSNorm(3), nn.Dropout(0.1), nn.MLP(4, 8),
    nn.MLP(4, 8, activation="swiglu", bias=False), nn.Attention(8, 4, n_kv_heads=2, rope=True),
    nn.TransformerBlock(8, 2, 16), nn.TransformerBlock(8, 4, 16, n_kv_heads=2, norm="rmsnorm",
                                                       activation="swiglu", bias=False, rope=True),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: type(layer).__name__)
def test_axes_mirror_params_and_init_is_deterministic(layer):
    p = layer.init(KEY)
    axes = layer.axes()
    ax_items, ax_def = cfx.tree.flatten_with_path(axes, is_leaf=is_axes_leaf)
    p_items, p_def = cfx.tree.flatten_with_path(p)
    assert [a for a, _ in ax_items] == [a for a, _ in p_items]
    for (path, names), (_, x) in zip(ax_items, p_items):
        assert len(names) == x.dim(), path
        assert set(names) <= {"vocab", "embed", "mlp", "heads", "kv_heads"}, path
        assert x.dtype == torch.float32, path
    assert cfx.tree.tree_allclose(layer.init(KEY), p, rtol=0, atol=0)
    weights = [x for x in cfx.tree.leaves(p) if x.dim() == 2]
    other = cfx.tree.leaves(layer.init(cfx.random.key(1)))
    assert all(not torch.equal(a, b) for a, b in zip(weights, [x for x in other if x.dim() == 2]))


def test_bf16_params_compute_in_bf16():
    blk = nn.TransformerBlock(8, 4, 16, n_kv_heads=2, norm="rmsnorm", activation="swiglu", rope=True)
    p = blk.init(KEY)
    x = randn(2, 4, 8, dtype=torch.float32)
    p16 = cfx.amp.policy("bf16").cast_to_compute(p)
    out = blk.apply(p16, x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), blk.apply(p, x), rtol=0.05, atol=0.05)


@settings(max_examples=5)
@given(st.integers(0, 2 ** 40))
def test_init_scale_matches_std(seed):
    lin = nn.Linear(64, 64, init_std=0.02)
    w = lin.init(cfx.random.key(seed))["w"]
    assert abs(w.std().item() - 0.02) < 0.002
    assert abs(nn.Linear(64, 64).init(cfx.random.key(seed))["w"].std().item() - 1 / 8) < 0.01


def test_conv2d_and_group_norm_equal_torch_nn_on_the_same_weights():
    g = torch.Generator().manual_seed(0)
    conv = cfx.nn.Conv2d(3, 5, kernel_size=3, stride=2, padding=1)
    p = cfx.tree.map(lambda t: torch.randn(t.shape, generator=g), conv.init(cfx.random.key(0)))
    ref = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)
    ref.load_state_dict({"weight": p["w"], "bias": p["b"]})  # torch's layout: no transpose
    x = torch.randn(2, 3, 9, 9, generator=g)
    torch.testing.assert_close(conv.apply(p, x), ref(x))
    assert conv.axes() == {"w": ("conv_out", "conv_in", "kernel", "kernel"), "b": ("conv_out",)}
    norm = cfx.nn.GroupNorm(2, 6, eps=1e-6)
    q = {"scale": torch.randn(6, generator=g), "bias": torch.randn(6, generator=g)}
    ref = torch.nn.GroupNorm(2, 6, eps=1e-6)
    ref.load_state_dict({"weight": q["scale"], "bias": q["bias"]})
    y = torch.randn(2, 6, 4, 4, generator=g)
    torch.testing.assert_close(norm.apply(q, y), ref(y))
    with pytest.raises(ValueError, match="do not split into 4 groups"):
        cfx.nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"x must be \(B, 3, H, W\)"):
        conv.apply(p, torch.randn(2, 4, 9, 9))
