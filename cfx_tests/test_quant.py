"""cfx.quant: int8 weight-only quantisation of a params pytree, and models applied to it."""
import pytest
import torch

import cfx
import cfx.quant
from cfx import models

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
    qparams = cfx.quant.quantize(params, "int8")
    assert cfx.quant.is_quantized(qparams["lm_head"]["w"])
    assert not cfx.quant.is_quantized(qparams["embed"]["w"])
    tokens = torch.randint(0, model.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.apply(qparams, tokens)
        want = model.apply(cfx.quant.dequantize(qparams), tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_min_size_and_skip_leave_small_or_named_layers_alone():
    params = {"small": {"w": torch.ones(8, 8), "b": torch.zeros(8)},
              "big": {"w": torch.ones(64, 64)}, "embed": {"w": torch.ones(64, 64)},
              "norm": {"scale": torch.ones(64)}}
    q = cfx.quant.quantize(params, "int8", min_size=1000)
    assert cfx.quant.is_quantized(q["big"]["w"])
    assert q["small"]["w"] is params["small"]["w"] and q["embed"]["w"] is params["embed"]["w"]
    q = cfx.quant.quantize(params, "int8", min_size=0, skip=())
    assert all(cfx.quant.is_quantized(q[k]["w"]) for k in ("small", "big", "embed"))


def test_bad_mode_and_mismatched_params_raise():
    with pytest.raises(ValueError, match="mode must be one of"):
        cfx.quant.quantize({}, "int4")
    model = models.gpt2("tiny")
    qparams = cfx.quant.quantize(model.init(cfx.random.key(0)), "int8")
    del qparams["blocks"][0]["mlp"]["fc"]["b"]
    with pytest.raises(ValueError, match=r"missing leaves \['blocks.0.mlp.fc.b'\]"):
        model.apply(qparams, torch.zeros(1, 4, dtype=torch.int64))
