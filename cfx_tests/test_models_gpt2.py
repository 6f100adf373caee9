"""cfx.models.GPT2 against Hugging Face GPT2LMHeadModel (random weights, nothing downloaded), compared in
fp64: the claim is the same function, which fp32 settles only up to each CPU's kernels."""
import dataclasses

import pytest
import torch

import cfx
from cfx import models
from cfx_tests.hf_helpers import FP32_LOSS, random_tokens, roughen, shifted_targets

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4)


def hf_gpt2(attn="eager", **overrides):
    torch.manual_seed(0)
    cfg = models.gpt2("tiny", **{**CFG, **overrides}).hf_config()
    cfg._attn_implementation = attn
    return roughen(transformers.GPT2LMHeadModel(cfg), ("ln_1.weight", "ln_2.weight", "ln_f.weight")).eval()


def tokens(B=3, T=16, seed=0, V=CFG["vocab_size"]):
    return random_tokens(B, T, V, seed)


@pytest.fixture(scope="module")
def hf_model():
    return hf_gpt2()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_hf(attn):
    hf = hf_gpt2(attn).double()
    model, params = models.from_hf(hf)
    assert model.config == models.GPT2Config.preset("tiny", **CFG)
    tok = tokens()
    with torch.no_grad():
        ref = hf(tok).logits
    out = model.apply(params, tok)
    assert out.shape == (3, 16, 97) and ref.abs().max() > 1.0
    torch.testing.assert_close(out, ref)


def test_loss_and_grads_match_hf():
    hf_model = hf_gpt2().double()
    model, params = models.from_hf(hf_model)
    tok = tokens()
    ref_loss = hf_model(tok, labels=tok).loss
    ref_loss.backward()
    loss, grads = cfx.value_and_grad(lambda p: model.loss(p, tok, shifted_targets(tok)))(params)
    # cfx keeps an fp64 model's loss in fp64; transformers' causal-LM loss takes logits.float() (FP32_LOSS)
    assert loss.dtype == torch.float64 and ref_loss.dtype == torch.float32
    torch.testing.assert_close(loss.float(), ref_loss.detach(), **FP32_LOSS)
    hf_grads = models.to_hf(model, grads)
    for name, p in hf_model.named_parameters():  # the tied wte appears once, with both uses' grads
        torch.testing.assert_close(hf_grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_loss_is_fp32_cross_entropy_of_logits(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens(seed=1)
    tgt = tokens(seed=2)
    tgt[0, :5] = -100
    logits = model.apply(params, tok).double()
    keep = tgt != -100
    ref = -logits.log_softmax(-1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0][keep].mean()
    torch.testing.assert_close(model.loss(params, tok, tgt).double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_matches_hf_attention_mask(side):
    hf_model = hf_gpt2().double()
    model, params = models.from_hf(hf_model)
    tok = tokens(B=2, T=12, seed=3)
    mask = torch.ones(2, 12, dtype=torch.bool)
    if side == "right":
        mask[0, 8:] = False
    else:
        mask[0, :4] = False
    with torch.no_grad():
        ref = hf_model(tok, attention_mask=mask.long()).logits
    out = model.apply(params, tok, mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[mask], ref[mask])
    diff = (model.apply(params, tok)[0][mask[0]] - out[0][mask[0]]).abs().max()
    if side == "right":  # causal: real tokens never see trailing padding, mask or not
        assert diff <= 1e-12
    else:  # without the mask, real tokens would attend to the leading padding
        assert diff > 1e-3


def test_cfx_init_round_trips_through_hf():
    model = models.gpt2("tiny", **CFG)
    params = model.init(cfx.random.key(3))
    sd = models.to_hf(model, params)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)
    model2, back = models.from_hf(sd, model=model)
    assert model2 is model
    assert cfx.tree.tree_allclose(back, params, rtol=0, atol=0)
    tok = tokens()
    with torch.no_grad():
        ref = hf.double()(tok).logits
    torch.testing.assert_close(model.apply(cfx.tree.map(lambda x: x.double(), params), tok), ref)


def test_init_follows_gpt2_scheme():
    model = models.gpt2("tiny", **{**CFG, "n_layer": 8, "n_embd": 256, "vocab_size": 1000})
    p = model.init(cfx.random.key(0))
    assert cfx.tree.tree_allclose(model.init(cfx.random.key(0)), p, rtol=0, atol=0)
    assert abs(p["wte"]["w"].std().item() - 0.02) < 1e-3
    resid = 0.02 / (2 * 8) ** 0.5
    for leaf in (p["blocks"][0]["attn"]["o"]["w"], p["blocks"][7]["mlp"]["proj"]["w"]):
        assert abs(leaf.std().item() - resid) < 0.1 * resid
    assert abs(p["blocks"][0]["mlp"]["fc"]["w"].std().item() - 0.02) < 1e-3
    assert torch.equal(p["ln_f"]["scale"], torch.ones(256)) and not p["blocks"][0]["attn"]["q"]["b"].any()
    assert not torch.equal(p["blocks"][0]["attn"]["q"]["w"], p["blocks"][1]["attn"]["q"]["w"])


def test_param_count_matches_hf_and_axes_mirror_params():
    model = models.gpt2("tiny")
    params = model.init(cfx.random.key(0))
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(model.hf_config())
    assert cfx.tree.tree_size(params) == sum(p.numel() for p in hf.parameters())
    axes = model.axes()
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    ax_items, _ = cfx.tree.flatten_with_path(axes, is_leaf=is_axes)
    p_items, _ = cfx.tree.flatten_with_path(params)
    assert [a for a, _ in ax_items] == [a for a, _ in p_items]
    assert all(len(a) == x.dim() for (_, a), (_, x) in zip(ax_items, p_items))
    assert axes["blocks"][2]["attn"]["q"]["w"] == ("embed", "heads")
    assert axes["blocks"][2]["mlp"]["proj"]["w"] == ("mlp", "embed")
    assert "blocks.3.attn.q.w" in cfx.tree.leaf_paths(params)


def test_presets():
    assert models.GPT2Config.preset("xl").n_embd == 1600
    assert models.gpt2("medium").config.n_layer == 24
    c = models.GPT2Config.preset("large", dropout=0.1)
    assert (c.n_layer, c.n_head, c.n_embd, c.dropout) == (36, 20, 1280, 0.1)
    with pytest.raises(ValueError, match=r"'huge'.*\['large', 'medium', 'small', 'tiny', 'xl'\]"):
        models.gpt2("huge")
    with pytest.raises(ValueError, match="n_embd=100 must be divisible by n_head=3"):
        models.gpt2("tiny", n_embd=100, n_head=3)


def test_dropout_is_keyed(hf_model):
    model, params = models.from_hf(hf_model)
    drop = dataclasses.replace(model, config=dataclasses.replace(model.config, dropout=0.2), blocks=None)
    tok = tokens(seed=4)
    k1, k2 = cfx.random.split(cfx.random.key(0))
    assert torch.equal(drop.apply(params, tok), model.apply(params, tok))  # key=None: no dropout
    a = drop.apply(params, tok, key=k1)
    assert torch.equal(a, drop.apply(params, tok, key=k1))
    assert not torch.allclose(a, drop.apply(params, tok, key=k2))
    g = cfx.grad(lambda p: drop.loss(p, tok, shifted_targets(tok), key=k1))(params)
    assert all(torch.isfinite(x).all() for x in cfx.tree.leaves(g))


def test_bf16_params_compute_in_bf16(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens(seed=5)
    p16 = cfx.amp.policy("bf16").cast_to_compute(params)
    logits = model.apply(p16, tok)
    assert logits.dtype == torch.bfloat16
    loss16 = model.loss(p16, tok, shifted_targets(tok))
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, model.loss(params, tok, shifted_targets(tok)), rtol=0.03, atol=0.03)


@dataclasses.dataclass(frozen=True)
class Counting:
    inner: object
    calls: list

    def init(self, key):
        return self.inner.init(key)

    def apply(self, params, x, **kw):
        self.calls.append(x.shape)
        return self.inner.apply(params, x, **kw)

    def axes(self):
        return self.inner.axes()


def test_map_blocks_routes_through_the_wrapper(hf_model):
    model, params = models.from_hf(hf_model)
    calls = []
    wrapped = model.map_blocks(lambda b: Counting(b, calls))
    tok = tokens(seed=6)
    assert torch.equal(wrapped.apply(params, tok), model.apply(params, tok))
    assert calls == [(3, 16, 64)] * 2 and model.blocks[0] is not wrapped.blocks[0]
    assert isinstance(wrapped, models.GPT2) and wrapped.config == model.config


def test_bad_inputs_raise_value_errors(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens()
    with pytest.raises(ValueError, match="2-D integer"):
        model.apply(params, tok.float())
    with pytest.raises(ValueError, match="2-D integer"):
        model.apply(params, tok[0])
    with pytest.raises(ValueError, match="n_positions=32"):
        model.apply(params, tokens(T=33))
    with pytest.raises(ValueError, match="vocab_size=97"):
        model.apply(params, tok.clone().fill_(97))
    with pytest.raises(ValueError, match="mask"):
        model.apply(params, tok, mask=torch.ones(3, 16))
    with pytest.raises(ValueError, match="targets shape"):
        model.loss(params, tok, tok[:, :-1])
    bad = cfx.tree.map(lambda x: x, params)
    del bad["blocks"][1]["attn"]["q"]["b"]
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.q\.b"):
        model.apply(bad, tok)
    mixed = cfx.tree.map(lambda x: x, params)
    mixed["blocks"][1]["mlp"]["fc"]["w"] = mixed["blocks"][1]["mlp"]["fc"]["w"].double()
    with pytest.raises(ValueError, match=r"params mix dtypes: blocks\.1\.mlp\.fc\.w \(torch\.float64\) .*"
                                         r"are torch\.float32.*cfx\.amp"):
        model.apply(mixed, tok)
    with pytest.raises(ValueError, match="model="):
        models.from_hf(hf_model.state_dict())
    other = models.gpt2("tiny", **{**CFG, "n_embd": 32})
    with pytest.raises(ValueError, match="wte.weight.*shape"):
        models.from_hf(hf_model.state_dict(), model=other)
    with pytest.raises(ValueError, match="unexpected keys.*h.2"):
        models.from_hf(hf_gpt2(n_layer=3).state_dict(), model=model)
