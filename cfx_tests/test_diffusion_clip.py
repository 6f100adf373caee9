"""The CLIP text encoder equals ``transformers.CLIPTextModel`` (hidden states, pooled output and
gradients; with and without padding; both of transformers' eos rules; compared in fp64, where the claim
of the same function does not rest on each CPU's fp32 kernels), and converts both ways."""
import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.diffusion.clip_text import (CLIPTextConfig, CLIPTextEncoder, clip_text, config_from_hf, from_hf,
                                          hf_config, to_hf_state_dict)
from cfx_tests.hf_helpers import FP32_SOFTMAX, roughen

transformers = pytest.importorskip("transformers")

from cfx_tests.budget import examples  # noqa: E402

V = 99
NORMS = ("layer_norm1.weight", "layer_norm2.weight", "final_layer_norm.weight")
_HF = {}


def hf_clip(eos=2, act="quick_gelu", attn="sdpa"):
    """A tiny random CLIPTextModel (built from a config, no network), weights moved off their init."""
    k = (eos, act, attn)
    if k not in _HF:
        config = transformers.CLIPTextConfig(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=77, eos_token_id=eos, bos_token_id=0, pad_token_id=1, hidden_act=act)
        model = transformers.CLIPTextModel(config).eval()
        model.config._attn_implementation = attn
        _HF[k] = roughen(model, NORMS, seed=len(_HF))
    return _HF[k]


def batch(lengths, T, eos, seed=0):
    """Right-padded rows (as CLIP's tokenizer pads): random ids, end-of-text at ``length - 1``, then
    padding. With the legacy eos id 2 the end-of-text is the highest id (98) and pads repeat it (SD's
    tokenizer pads with <|endoftext|>): the first of the ties must be pooled. Otherwise the ids avoid
    ``eos`` but include higher ones (so an argmax rule would pool elsewhere) and pads repeat ``eos``."""
    g = torch.Generator().manual_seed(seed)
    eot = V - 1 if eos == 2 else eos
    tokens = torch.randint(3, V - 1, (len(lengths), T), generator=g)
    tokens = torch.where(tokens == eot, eot + 1, tokens)
    lengths = torch.tensor(lengths)
    pos = torch.arange(T)[None, :]
    tokens = torch.where(pos >= lengths[:, None] - 1, eot, tokens)
    return tokens, pos < lengths[:, None]  # (B, T) ids, (B, T) True = real token


def in_float64(hf):
    """A copy of ``hf`` in fp64 and its cfx conversion: ``(hf64, enc, params64)``."""
    hf64 = copy.deepcopy(hf).double()
    return (hf64, *from_hf(hf64))


def hf_out(hf, tokens, mask):
    out = hf(tokens, attention_mask=None if mask is None else mask.long())
    return out.last_hidden_state, out.pooler_output


@pytest.mark.parametrize("eos,act,masked,attn", [
    (2, "quick_gelu", False, "sdpa"), (2, "quick_gelu", True, "sdpa"), (2, "quick_gelu", True, "eager"),
    (7, "quick_gelu", False, "sdpa"), (7, "quick_gelu", True, "sdpa"), (7, "gelu", True, "eager")])
def test_outputs_equal_hugging_face(eos, act, masked, attn):
    hf, enc, params = in_float64(hf_clip(eos, act, attn))
    assert enc.config.eos_token_id == eos and enc.config.hidden_act == act
    tokens, mask = batch([12, 7, 3, 1], 12, eos)
    mask = mask if masked else None
    with torch.no_grad():
        want_h, want_p = hf_out(hf, tokens, mask)
    h, p = enc.apply(params, tokens, mask)
    tol = FP32_SOFTMAX if attn == "eager" else {}  # eager: transformers' fp32 softmax (hf_helpers)
    torch.testing.assert_close(h, want_h, **tol)
    torch.testing.assert_close(p, want_p, **tol)


def test_pooling_rules_read_the_right_position():
    # Without eos among the ids the new rule pools position 0; the legacy one the first highest id.
    enc_new = CLIPTextEncoder(CLIPTextConfig.preset("tiny", vocab_size=V, eos_token_id=7))
    enc_old = CLIPTextEncoder(CLIPTextConfig.preset("tiny", vocab_size=V))
    tokens = torch.tensor([[5, 9, 7, 50, 7], [5, 9, 8, 50, 50], [98, 3, 7, 98, 98]])
    assert enc_new.eos_positions(tokens).tolist() == [2, 0, 2]
    assert enc_old.eos_positions(tokens).tolist() == [3, 3, 0]


@pytest.mark.parametrize("prefix", ["", "text_model."])
def test_state_dict_round_trips(prefix):
    hf = hf_clip(7)
    enc, params = from_hf(hf)
    sd = to_hf_state_dict(enc, params, prefix=prefix)
    if prefix:  # SD's text_encoder checkpoints also carry the position_ids buffer
        sd[prefix + "embeddings.position_ids"] = torch.arange(77)[None]
    enc2, params2 = from_hf(sd, config=enc.config)
    assert enc2 == enc
    for a, b in zip(cfx.tree.leaves(params), cfx.tree.leaves(params2)):
        assert torch.equal(a, b)
    if prefix:
        return
    fresh = transformers.CLIPTextModel(hf_config(enc.config)).eval()
    fresh.load_state_dict(sd, strict=True)
    tokens, mask = batch([9, 4], 9, 7, seed=3)
    with torch.no_grad():
        want_h, want_p = hf_out(fresh, tokens, mask)
        src_h, src_p = hf_out(hf, tokens, mask)
    torch.testing.assert_close(want_h, src_h, rtol=0, atol=0)
    torch.testing.assert_close(want_p, src_p, rtol=0, atol=0)
    fresh64, enc, params = in_float64(fresh)
    with torch.no_grad():
        want_h, want_p = hf_out(fresh64, tokens, mask)
    h, p = enc.apply(params, tokens, mask)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(p, want_p)


def test_cfx_init_runs_in_hugging_face():
    enc = clip_text("tiny", vocab_size=V, max_position_embeddings=16, eos_token_id=7)
    params = enc.init(cfx.random.key(1))
    assert config_from_hf(hf_config(enc.config)) == enc.config
    hf = transformers.CLIPTextModel(hf_config(enc.config)).eval().double()
    params = cfx.tree.map(lambda x: x.double(), params)
    hf.load_state_dict(to_hf_state_dict(enc, params), strict=True)
    tokens, mask = batch([16, 5], 16, 7, seed=4)
    with torch.no_grad():
        want_h, want_p = hf_out(hf, tokens, mask)
    h, p = enc.apply(params, tokens, mask)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(p, want_p)


@pytest.mark.parametrize("eos,masked", [(2, True), (7, False)])
def test_gradients_equal_hugging_face(eos, masked):
    hf = transformers.CLIPTextModel(hf_clip(eos).config).double()
    hf.load_state_dict(hf_clip(eos).state_dict())
    hf.eval()
    enc, params = from_hf(hf)
    tokens, mask = batch([10, 6, 2], 10, eos, seed=1)
    mask = mask if masked else None
    g = torch.Generator().manual_seed(2)
    w_h = torch.randn(3, 10, 32, generator=g, dtype=torch.float64)
    w_p = torch.randn(3, 32, generator=g, dtype=torch.float64)

    def scalar(h, p):
        return (h * w_h).sum() + 3.0 * (p * w_p).sum()

    grads = cfx.grad(lambda ps: scalar(*enc.apply(ps, tokens, mask)))(params)
    scalar(*hf_out(hf, tokens, mask)).backward()
    got = to_hf_state_dict(enc, grads)
    want = {k: p.grad for k, p in hf.named_parameters()}
    assert set(got) == set(want)
    for k, g_ in want.items():
        torch.testing.assert_close(got[k], g_, msg=lambda m: f"{k}: {m}")


@examples(ci=5)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3), extra=st.integers(0, 4),
       eos=st.sampled_from([2, 7]), masked=st.booleans())
def test_any_batch_and_length_equal_hugging_face(lengths, extra, eos, masked):
    T = max(lengths) + extra
    hf, enc, params = in_float64(hf_clip(eos))
    tokens, mask = batch(lengths, T, eos, seed=T)
    mask = mask if masked else None
    with torch.no_grad():
        want_h, want_p = hf_out(hf, tokens, mask)
    h, p = enc.apply(params, tokens, mask)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(p, want_p)


def test_map_blocks_and_axes():
    enc, params = from_hf(hf_clip(7))
    tokens, mask = batch([8, 5], 8, 7)
    ref = enc.map_blocks(lambda b: dataclasses.replace(b, attn_impl="reference"))
    assert ref.blocks[0].attn_impl == "reference" and type(ref.blocks[0]) is type(enc.blocks[0])
    for a, b in zip(enc.apply(params, tokens, mask), ref.apply(params, tokens, mask)):
        torch.testing.assert_close(a, b)
    axes = enc.axes()
    flat_axes = cfx.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_params = cfx.tree.leaves(params)
    assert len(flat_axes) == len(flat_params)
    for names, x in zip(flat_axes, flat_params):
        assert len(names) == x.dim()
    assert axes["wte"]["w"] == ("vocab", "embed") and axes["blocks"][0]["mlp"]["fc"]["w"] == ("embed", "mlp")


def test_sd15_preset_matches_the_hugging_face_architecture():
    enc = clip_text("sd15")
    shapes = cfx.eval_shape(enc.init, cfx.random.key(0))
    n = sum(math.prod(s.shape) for s in cfx.tree.leaves(shapes))
    with torch.device("meta"):
        hf = transformers.CLIPTextModel(hf_config(enc.config))
    assert n == sum(p.numel() for p in hf.parameters()) == 123_060_480
    assert (enc.config.hidden_act, enc.config.eos_token_id, enc.config.max_position_embeddings) == ("quick_gelu", 2, 77)


def test_bad_inputs_raise_value_errors():
    enc, params = from_hf(hf_clip(7))
    tokens, mask = batch([5, 3], 5, 7)
    with pytest.raises(ValueError, match="vocab_size=99"):
        enc.apply(params, tokens.masked_fill(tokens == 7, V))
    with pytest.raises(ValueError, match="vocab_size=99"):
        enc.apply(params, tokens - 10)
    with pytest.raises(ValueError, match="max_position_embeddings=77"):
        enc.apply(params, torch.full((1, 78), 7))
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of the tokens' shape \(2, 5\)"):
        enc.apply(params, tokens, mask[:, :4])
    with pytest.raises(ValueError, match="bool"):
        enc.apply(params, tokens, mask.long())
    with pytest.raises(ValueError, match="2-D integer"):
        enc.apply(params, tokens[0])
    with pytest.raises(ValueError, match="params differ"):
        enc.apply({**params, "blocks": params["blocks"][:1]}, tokens)
    with pytest.raises(ValueError, match="hidden_act"):
        CLIPTextConfig(hidden_act="relu")
    with pytest.raises(ValueError, match="eos_token_id"):
        CLIPTextConfig.preset("tiny", vocab_size=V, eos_token_id=49407)
    with pytest.raises(ValueError, match="unknown preset"):
        CLIPTextConfig.preset("sdxl")
    with pytest.raises(ValueError, match="pass config="):
        from_hf(to_hf_state_dict(enc, params))
    more = dataclasses.replace(enc.config, num_hidden_layers=1)
    with pytest.raises(ValueError, match="unexpected keys"):
        from_hf(to_hf_state_dict(enc, params), config=more)
    with pytest.raises(ValueError, match="expects"):
        from_hf(to_hf_state_dict(enc, params), config=dataclasses.replace(enc.config, intermediate_size=40))
