"""cfx.quant: int8 weight-only quantisation of a params pytree, and models applied to it."""
import pytest
import torch

import cfx
import cfx.quant
from cfx import models
from cfx._src.precision.quant import floating_dtype

# GPT-2 small, random init (std 0.02), 2 x 64 random tokens: measured max |logit error| 0.067
# with logits up to 2.9 (std 0.55), relative RMS error 2.2%, top-1 agreement 94.5% (random-init
# logits are nearly flat, so argmax flips easily). The bounds asserted leave about 2x headroom.
MAX_ABS_ERR = 0.15
MAX_REL_RMS_ERR = 0.05
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def gpt2_small():
    model = models.gpt2("small")
    params = model.init(cfx.random.key(0))
    qparams = cfx.quant.quantize(params, "int8")
    tokens = torch.randint(0, model.config.vocab_size, (2, 64),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model, params, qparams, model.apply(params, tokens), model.apply(qparams, tokens), tokens


def linear_weights(tree):
    return [x for x in cfx.tree.leaves(tree, is_leaf=cfx.quant.is_quantized)
            if cfx.quant.is_quantized(x)]


def test_gpt2_small_logits_stay_close_to_fp32(gpt2_small):
    _, _, _, ref, out, _ = gpt2_small
    err = (out - ref).abs()
    rel_rms = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert err.max().item() <= MAX_ABS_ERR, err.max()
    assert rel_rms <= MAX_REL_RMS_ERR, rel_rms
    assert top1 >= MIN_TOP1_AGREEMENT, top1
    assert err.max().item() > 0  # the int8 path really ran


def test_gpt2_small_int8_path_equals_the_dequantised_model(gpt2_small):
    # the int8 matmul computes exactly the fp32 model whose weights are q * scale
    model, _, qparams, _, out, tokens = gpt2_small
    with torch.no_grad():
        want = model.apply(cfx.quant.dequantize(qparams), tokens)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_gpt2_small_linear_weights_shrink_to_a_quarter(gpt2_small):
    _, params, qparams, *_ = gpt2_small
    quantized = linear_weights(qparams)
    assert len(quantized) == 12 * 6  # q, k, v, o, fc, proj per block
    fp32_bytes = sum(4 * w.q.numel() for w in quantized)
    int8_bytes = cfx.tree.tree_bytes(quantized)  # int8 q plus fp32 scales
    ratio = int8_bytes / fp32_bytes
    assert 0.25 <= ratio <= 0.252, ratio  # 1/4 + 1/in_features (the scales)
    # everything else is untouched: embeddings (the tied head reads wte), norms, biases
    saved = cfx.tree.tree_bytes(params) - cfx.tree.tree_bytes(qparams)
    assert saved == fp32_bytes - int8_bytes
    assert qparams["wte"]["w"] is params["wte"]["w"] and qparams["wpe"]["w"] is params["wpe"]["w"]
    assert qparams["blocks"][0]["attn"]["q"]["b"] is params["blocks"][0]["attn"]["q"]["b"]


def test_paths_name_the_int8_and_scale_leaves():
    model = models.gpt2("tiny")
    qparams = cfx.quant.quantize(model.init(cfx.random.key(0)), "int8")
    paths = cfx.tree.leaf_paths(qparams)
    assert "blocks.0.attn.q.w.q" in paths and "blocks.0.attn.q.w.scale" in paths
    assert "wte.w" in paths and "blocks.0.norm1.scale" in paths


def test_llama_untied_head_is_quantized_and_embedding_is_not():
    model = models.llama("tiny", tie_embeddings=False)
    params = model.init(cfx.random.key(0))
    qparams = cfx.quant.quantize(params, "int8", axes=model.axes())  # the axes tell the table apart
    assert cfx.quant.is_quantized(qparams["lm_head"]["w"])
    assert cfx.quant.is_quantized(qparams["blocks"][0]["mlp"]["gate"]["w"])
    assert not cfx.quant.is_quantized(qparams["embed"]["w"])
    tokens = torch.randint(0, model.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.apply(qparams, tokens)
        want = model.apply(cfx.quant.dequantize(qparams), tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_min_size_and_skip_leave_small_or_named_layers_alone():
    params = {"small": {"w": torch.ones(8, 8), "b": torch.zeros(8)},
              "big": {"w": torch.ones(64, 64), "b": torch.zeros(64)}, "other": {"w": torch.ones(64, 64), "b": torch.zeros(64)},
              "norm": {"scale": torch.ones(64)}}
    q = cfx.quant.quantize(params, "int8", min_size=1000, skip=("other",))
    assert cfx.quant.is_quantized(q["big"]["w"])
    assert q["small"]["w"] is params["small"]["w"] and q["other"]["w"] is params["other"]["w"]
    q = cfx.quant.quantize(params, "int8", min_size=0)
    assert all(cfx.quant.is_quantized(q[k]["w"]) for k in ("small", "big", "other"))


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt", "bert"])
def test_the_axes_keep_every_lookup_table_and_quantize_every_linear(family):
    # no family's key names: a table is a weight whose first logical axis is "vocab" or "positions"
    model = getattr(models, family)("tiny")
    params = model.init(cfx.random.key(0))
    q = cfx.quant.quantize(params, "int8", axes=model.axes(), min_size=0)
    kept = {path for path, x in cfx.tree.flatten_with_path(q, is_leaf=cfx.quant.is_quantized)[0]
            if not cfx.quant.is_quantized(x) and x.dim() == 2}
    axes = dict(cfx.tree.flatten_with_path(model.axes(), is_leaf=cfx.tree.is_axes_leaf)[0])
    assert kept and all(axes[p][0] in ("vocab", "positions") for p in kept), kept
    assert len(linear_weights(q)) >= 4 * len(model.blocks)  # q, k, v, o at least, per block


def test_without_axes_a_bias_free_weight_stays_and_bad_axes_are_named():
    # {"w"} alone may be an embedding table: without the model's axes it is left in floating point
    params = {"lin": {"w": torch.ones(64, 64), "b": torch.zeros(64)}, "table": {"w": torch.ones(64, 64)}}
    q = cfx.quant.quantize(params, "int8", min_size=0)
    assert cfx.quant.is_quantized(q["lin"]["w"]) and q["table"]["w"] is params["table"]["w"]
    q = cfx.quant.quantize(params, "int8", min_size=0, axes={"lin": {"w": ("embed", "mlp"), "b": ("mlp",)},
                                                             "table": {"w": ("embed", "mlp")}})
    assert cfx.quant.is_quantized(q["table"]["w"])
    with pytest.raises(ValueError, match=r"axes \(pass model.axes\(\)\)"):
        cfx.quant.quantize(params, "int8", axes={"lin": {"w": ("embed", "mlp")}})


def test_bad_mode_and_mismatched_params_raise():
    with pytest.raises(ValueError, match="mode must be one of"):
        cfx.quant.quantize({}, "int4")
    model = models.gpt2("tiny")
    qparams = cfx.quant.quantize(model.init(cfx.random.key(0)), "int8")
    del qparams["blocks"][0]["mlp"]["fc"]["b"]
    with pytest.raises(ValueError, match=r"missing leaves \['blocks.0.mlp.fc.b'\]"):
        model.apply(qparams, torch.zeros(1, 4, dtype=torch.int64))


# -- convolutions ---------------------------------------------------------------------------------------
def conv_weight(out=16, cin=8, k=3, seed=0):
    """A conv weight whose output channels differ in magnitude by up to 30x (a per-tensor scale would
    then round the small channels to a few levels), with channel 3 all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cin, k, k, generator=g) * torch.logspace(-1.5, 0, out)[:, None, None, None]
    w[3] = 0
    return w


def test_conv_weights_quantise_per_output_channel():
    w, b = conv_weight(), torch.randn(16)
    params = {"conv": {"w": w, "b": b}}
    qp = cfx.quant.quantize(params, "int8", min_size=0)
    qw = qp["conv"]["w"]
    assert cfx.quant.is_quantized(qw) and qp["conv"]["b"] is b
    assert qw.q.dtype == torch.int8 and tuple(qw.q.shape) == (16, 8, 3, 3)
    assert qw.scale.dtype == torch.float32 and tuple(qw.scale.shape) == (16, 1, 1, 1)
    # scale: each output channel's absmax / 127 (1 for the zero channel), so its absmax maps to +-127
    amax = w.abs().amax(dim=(1, 2, 3))  # (out,)
    want_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    torch.testing.assert_close(qw.scale.flatten(), want_scale, rtol=0, atol=0)
    nonzero = amax > 0
    assert torch.equal(qw.q.abs().amax(dim=(1, 2, 3))[nonzero], torch.full((15,), 127, dtype=torch.int8))
    assert torch.equal(qw.q[3], torch.zeros_like(qw.q[3])) and torch.equal(qw.dequantize()[3], w[3])
    # round to nearest: every element within half a step of its channel's scale
    err = (qw.dequantize() - w).abs()
    assert bool((err <= want_scale[:, None, None, None] / 2 * (1 + 1e-6)).all()), (err / qw.scale).max()
    assert err.max() > 0
    torch.testing.assert_close(cfx.quant.dequantize(qp)["conv"]["w"], qw.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_with_an_int8_weight_is_conv2d_of_the_dequantised_weight(dtype):
    import torch.nn.functional as F
    conv = cfx.nn.Conv2d(8, 16, 3, stride=2, padding=1)
    params = cfx.tree.map(lambda x: x.to(dtype), {**conv.init(cfx.random.key(0)), "b": torch.randn(16)})
    qparams = cfx.quant.quantize(params, "int8", min_size=0)
    x = torch.randn(2, 8, 9, 9, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = conv.apply(qparams, x)
    w = qparams["w"].dequantize().to(dtype)
    assert got.dtype == dtype and got.shape == (2, 16, 5, 5)
    torch.testing.assert_close(got, F.conv2d(x, w, params["b"], stride=2, padding=1), rtol=0, atol=0)
    fp = conv.apply(params, x)
    assert 0 < float((got.float() - fp.float()).abs().max()) < 0.05 * float(fp.float().abs().max())


def test_min_size_and_kinds_pick_the_weights():
    params = {"lin": {"w": torch.randn(64, 64), "b": torch.zeros(64)}, "conv": {"w": torch.randn(16, 16, 3, 3), "b": torch.zeros(16)},
              "small_conv": {"w": torch.randn(4, 4, 1, 1)}, "conv1d": {"w": torch.randn(16, 16, 16)},
              "int_conv": {"w": torch.ones(16, 16, 3, 3, dtype=torch.int32)}}
    kept = lambda q: sorted(k for k in q if cfx.quant.is_quantized(q[k]["w"]))  # noqa: E731
    assert kept(cfx.quant.quantize(params, "int8", min_size=1000)) == ["conv", "lin"]
    assert kept(cfx.quant.quantize(params, "int8", min_size=0)) == ["conv", "lin", "small_conv"]
    assert kept(cfx.quant.quantize(params, "int8", min_size=0, kinds=("linear",))) == ["lin"]
    assert kept(cfx.quant.quantize(params, "int8", min_size=0, kinds=("conv",))) == ["conv", "small_conv"]
    assert kept(cfx.quant.quantize(params, "int8", min_size=0, kinds=())) == []
    for bad in ("conv", ("conv", "conv1d"), None):
        with pytest.raises(ValueError, match=r"kinds must be a tuple of names from \('linear', 'conv'\)"):
            cfx.quant.quantize(params, "int8", kinds=bad)


def test_a_quantised_conv_takes_a_quarter_of_the_bytes():
    w = conv_weight(out=64, cin=64)
    q = cfx.quant.quantize({"w": w}, "int8", min_size=0)
    ratio = cfx.tree.tree_bytes(q) / cfx.tree.tree_bytes({"w": w})
    assert 0.25 <= ratio <= 0.25 + 1 / (64 * 3 * 3), ratio  # int8 q, plus one fp32 scale per 576 weights


def test_floating_dtype_looks_past_the_fp32_scales():
    bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    # "a" (a bias-less conv, whose only floating tensor is the fp32 scale) comes before "norm"
    params = {"a": {"w": bf16(conv_weight())}, "norm": {"scale": bf16(torch.ones(16))}}
    assert floating_dtype(cfx.quant.quantize(params, "int8", min_size=0)) == torch.bfloat16
    assert floating_dtype(cfx.quant.quantize({"w": conv_weight()}, min_size=0)) == torch.float32
    with pytest.raises(ValueError, match="no floating-point tensor"):
        floating_dtype({"ids": torch.zeros(3, dtype=torch.int64)})
