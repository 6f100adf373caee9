"""cfx.models.Llama against Hugging Face LlamaForCausalLM (random weights, nothing downloaded), compared in
fp64: the claim is the same function, which fp32 settles only up to each CPU's kernels."""
import dataclasses

import pytest
import torch

import cfx
from cfx import models
from cfx_tests.hf_helpers import FP32_LOSS, FP32_SOFTMAX, random_tokens, roughen, shifted_targets

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=101, hidden_size=64, intermediate_size=96, n_layer=2, n_head=4, n_kv_heads=2,
           rope_theta=500.0, rms_norm_eps=1e-5, max_position_embeddings=32)
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")
# (n_kv_heads, tie_embeddings): GQA, tied MHA, multi-query
VARIANTS = [(2, False), (4, True), (1, False)]


def hf_llama(attn="eager", **overrides):
    torch.manual_seed(0)
    cfg = models.llama("tiny", **{**CFG, **overrides}).hf_config()
    cfg._attn_implementation = attn
    return roughen(transformers.LlamaForCausalLM(cfg), NORMS).eval()


def tokens(B=3, T=16, seed=0, V=CFG["vocab_size"]):
    return random_tokens(B, T, V, seed)


@pytest.fixture(scope="module")
def hf_model():
    return hf_llama()


def test_hf_config_carries_rope_theta_and_gqa():
    cfg = models.llama("tiny", **CFG).hf_config()
    theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
    assert theta == 500.0
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps) == (2, 16, 1e-5)
    assert models.model_from_hf_config(cfg).config == models.LlamaConfig.preset("tiny", **CFG)


@pytest.mark.parametrize("kv,tie", VARIANTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_hf(attn, kv, tie):
    hf = hf_llama(attn, n_kv_heads=kv, tie_embeddings=tie).double()
    model, params = models.from_hf(hf)
    expected = models.LlamaConfig.preset("tiny", **{**CFG, "n_kv_heads": kv, "tie_embeddings": tie})
    assert model.config == expected
    assert ("lm_head" in params) == (not tie)
    assert params["blocks"][0]["attn"]["k"]["w"].shape == (64, kv * 16)
    tok = tokens()
    with torch.no_grad():
        ref = hf(tok).logits
    out = model.apply(params, tok)
    assert out.shape == (3, 16, 101) and ref.abs().max() > 1.0
    torch.testing.assert_close(out, ref, **(FP32_SOFTMAX if attn == "eager" else {}))  # eager: its fp32 softmax


@pytest.mark.parametrize("kv,tie", VARIANTS)
def test_loss_and_grads_match_hf(kv, tie):
    hf = hf_llama("sdpa", n_kv_heads=kv, tie_embeddings=tie).double()  # sdpa: fp64 throughout
    model, params = models.from_hf(hf)
    tok = tokens(seed=1)
    ref_loss = hf(tok, labels=tok).loss
    ref_loss.backward()
    loss, grads = cfx.value_and_grad(lambda p: model.loss(p, tok, shifted_targets(tok)))(params)
    # cfx keeps an fp64 model's loss in fp64; transformers' causal-LM loss takes logits.float() (FP32_LOSS)
    assert loss.dtype == torch.float64 and ref_loss.dtype == torch.float32
    torch.testing.assert_close(loss.float(), ref_loss.detach(), **FP32_LOSS)
    hf_grads = models.to_hf(model, grads)
    for name, p in hf.named_parameters():  # tied: embed_tokens appears once, with both uses' grads
        torch.testing.assert_close(hf_grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_matches_hf_attention_mask(side):
    hf_model = hf_llama("sdpa").double()  # (eager in fp64 casts its finfo.min mask to -inf in fp32: NaN rows)
    model, params = models.from_hf(hf_model)
    tok = tokens(B=2, T=12, seed=3)
    mask = torch.ones(2, 12, dtype=torch.bool)
    if side == "right":
        mask[1, 7:] = False
    else:
        mask[1, :5] = False
    with torch.no_grad():
        ref = hf_model(tok, attention_mask=mask.long()).logits
    out = model.apply(params, tok, mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[mask], ref[mask])
    diff = (model.apply(params, tok)[1][mask[1]] - out[1][mask[1]]).abs().max()
    assert diff <= 1e-12 if side == "right" else diff > 1e-3


@pytest.mark.parametrize("kv,tie", VARIANTS)
def test_cfx_init_round_trips_through_hf(kv, tie):
    model = models.llama("tiny", **{**CFG, "n_kv_heads": kv, "tie_embeddings": tie})
    params = model.init(cfx.random.key(7))
    sd = models.to_hf(model, params)
    hf = transformers.LlamaForCausalLM(model.hf_config()).eval()
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)
    _, back = models.from_hf(sd, model=model)
    assert cfx.tree.tree_allclose(back, params, rtol=0, atol=0)
    tok = tokens()
    with torch.no_grad():
        ref = hf.double()(tok).logits
    torch.testing.assert_close(model.apply(cfx.tree.map(lambda x: x.double(), params), tok), ref)


def test_axes_mirror_params_and_init_is_deterministic():
    for tie in (False, True):
        model = models.llama("tiny", **{**CFG, "tie_embeddings": tie})
        params = model.init(cfx.random.key(0))
        assert cfx.tree.tree_allclose(model.init(cfx.random.key(0)), params, rtol=0, atol=0)
        is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
        ax_items, _ = cfx.tree.flatten_with_path(model.axes(), is_leaf=is_axes)
        p_items, _ = cfx.tree.flatten_with_path(params)
        assert [a for a, _ in ax_items] == [a for a, _ in p_items]
        assert all(len(a) == x.dim() for (_, a), (_, x) in zip(ax_items, p_items))
    axes = model.axes()
    assert axes["blocks"][0]["attn"]["k"]["w"] == ("embed", "kv_heads")
    assert axes["blocks"][0]["mlp"]["down"]["w"] == ("mlp", "embed")
    assert "lm_head" not in axes and "lm_head" not in params


# Published parameter counts of the shapes the presets copy.
@pytest.mark.parametrize("name,count", [("1b", 1_235_814_400), ("7b", 6_738_415_616),
                                        ("8b", 8_030_261_248)])
def test_real_presets_have_published_sizes(name, count):
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(models.llama(name).hf_config())
    assert sum(p.numel() for p in hf.parameters()) == count


def test_tiny_preset_param_count_matches_hf():
    model = models.llama("tiny")
    assert (model.config.n_kv_heads, model.config.vocab_size) == (2, 32000)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(model.hf_config())
    assert cfx.tree.tree_size(model.init(cfx.random.key(0))) == sum(p.numel() for p in hf.parameters())


def test_bf16_and_map_blocks(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens(seed=5)
    p16 = cfx.amp.policy("bf16").cast_to_compute(params)
    assert model.apply(p16, tok).dtype == torch.bfloat16
    torch.testing.assert_close(model.loss(p16, tok, shifted_targets(tok)),
                               model.loss(params, tok, shifted_targets(tok)), rtol=0.03, atol=0.03)
    seen = []

    @dataclasses.dataclass(frozen=True)
    class SkipBlock:  # a layer transform: same init / apply / axes, different apply
        inner: object

        def init(self, key):
            return self.inner.init(key)

        def apply(self, params, x, **kw):
            seen.append(kw.keys())
            return x + 0.0 * self.inner.apply(params, x, **kw)

        def axes(self):
            return self.inner.axes()

    skipped = model.map_blocks(SkipBlock)
    assert isinstance(skipped, models.Llama) and skipped.config == model.config
    # Each wrapped block is called once, and the model uses what the wrapper returns.
    torch.testing.assert_close(skipped.apply(params, tok), _head_only(model, params, tok))
    assert len(seen) == 2


def _head_only(model, params, tok):
    c = model.config
    x = params["embed"]["w"][tok]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * params["norm"]["scale"]
    return x @ params["lm_head"]["w"]


def test_bad_inputs_raise_value_errors(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens()
    with pytest.raises(ValueError, match="2-D integer"):
        model.apply(params, tok[None])
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        model.apply(params, tokens(T=40))
    with pytest.raises(ValueError, match=r"\[0, vocab_size=101\)"):
        model.loss(params, tok, tok + 100)
    with pytest.raises(ValueError, match=r"'2b'.*\['1b', '7b', '8b', 'tiny'\]"):
        models.llama("2b")
    with pytest.raises(ValueError, match="n_head=4 must be a multiple of n_kv_heads=3"):
        models.llama("tiny", **{**CFG, "n_kv_heads": 3})
    bad = {k: v for k, v in params.items() if k != "lm_head"}
    with pytest.raises(ValueError, match="lm_head.w"):
        model.apply(bad, tok)
    tied = models.llama("tiny", **{**CFG, "tie_embeddings": True})
    with pytest.raises(ValueError, match="unexpected leaves.*lm_head.w"):
        tied.apply(params, tok)
    with pytest.raises(ValueError, match="no 'lm_head.weight'"):
        models.from_hf(hf_model.model.state_dict(), model=model)
    cfg = hf_model.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    with pytest.raises(ValueError, match="RoPE type 'linear'"):
        models.model_from_hf_config(transformers.LlamaConfig(**cfg))
