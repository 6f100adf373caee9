"""cfx.models.OPT against Hugging Face OPTForCausalLM (random weights, nothing downloaded): pre-LN
and post-LN with project_in / project_out (OPT-350m's layout), tied and untied heads, compared in fp64
(the claim is the same function, which fp32 settles only up to each CPU's kernels); and the same
model tensor-parallel and under a Plan, equal to one device."""
import dataclasses

import pytest
import torch

import cfx
from cfx import P, models
from cfx.parallel import MEGATRON_RULES, Plan, tensor_parallel
from cfx_tests.hf_helpers import FP32_LOSS, FP32_SOFTMAX, random_tokens, roughen, shifted_targets

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=96, hidden_size=64, n_layer=2, n_head=4, ffn_dim=96, max_position_embeddings=32)
NORMS = ("self_attn_layer_norm.weight", "final_layer_norm.weight")
VARIANTS = {  # name -> overrides
    "pre_ln": {},
    "post_ln_proj": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # OPT-350m's layout
    "pre_ln_proj_untied": dict(word_embed_proj_dim=48, tie_embeddings=False),
}


def small(**overrides):
    return models.opt("tiny", **{**CFG, **overrides})


def hf_opt(attn="eager", **overrides):
    torch.manual_seed(0)
    cfg = small(**overrides).hf_config()
    cfg._attn_implementation = attn
    return roughen(transformers.OPTForCausalLM(cfg), NORMS).eval()


def tokens(B=3, T=16, seed=0):
    tok = random_tokens(B, T, CFG["vocab_size"], seed)
    tok[0, 3] = 1  # the pad id: HF's padding_idx row takes no gradient from lookups
    return tok


@pytest.fixture(scope="module")
def hf_model():
    return hf_opt()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_hf(attn, variant):
    hf = hf_opt(attn, **VARIANTS[variant]).double()
    model, params = models.from_hf(hf)
    assert model.config == small(**VARIANTS[variant]).config
    tok = tokens()
    with torch.no_grad():
        ref = hf(tok).logits
    out = model.apply(params, tok)
    assert out.shape == (3, 16, 96) and ref.abs().max() > 1.0
    torch.testing.assert_close(out, ref, **(FP32_SOFTMAX if attn == "eager" else {}))  # eager: its fp32 softmax


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_grads_match_hf(variant):
    hf = hf_opt("sdpa", **VARIANTS[variant]).double()  # sdpa: fp64 throughout
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
    # HF numbers positions by real tokens (cumsum of the mask), so left padding shifts them
    hf_model = hf_opt("sdpa").double()  # (eager in fp64 casts its finfo.min mask to -inf in fp32: NaN rows)
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
    if side == "left":  # a left-padded row's real tokens equal the same tokens unpadded
        torch.testing.assert_close(out[1, 5:], model.apply(params, tok[1:, 5:])[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_cfx_init_round_trips_through_hf(variant):
    model = small(**VARIANTS[variant])
    params = model.init(cfx.random.key(7))
    sd = models.to_hf(model, params)
    hf = transformers.OPTForCausalLM(model.hf_config()).eval()
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)
    tok = tokens()
    with torch.no_grad():
        ref = hf.double()(tok).logits
    torch.testing.assert_close(model.apply(cfx.tree.map(lambda x: x.double(), params), tok), ref)
    model2, back = models.from_hf(sd, model=model)
    assert model2 is model
    assert cfx.tree.tree_allclose(back, params, rtol=0, atol=0)
    base = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}  # OPTModel's keys
    if model.config.tie_embeddings:
        assert cfx.tree.tree_allclose(models.from_hf(base, model=model)[1], params, rtol=0, atol=0)


def test_axes_mirror_params_and_name_the_projections():
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    for overrides in VARIANTS.values():
        model = small(**overrides)
        params = model.init(cfx.random.key(0))
        assert cfx.tree.tree_allclose(model.init(cfx.random.key(0)), params, rtol=0, atol=0)
        ax_items, _ = cfx.tree.flatten_with_path(model.axes(), is_leaf=is_axes)
        p_items, _ = cfx.tree.flatten_with_path(params)
        assert [a for a, _ in ax_items] == [a for a, _ in p_items]
        assert all(len(a) == x.dim() for (_, a), (_, x) in zip(ax_items, p_items))
    axes = small(**VARIANTS["post_ln_proj"]).axes()
    assert list(axes) == ["wte", "wpe", "project_in", "blocks", "project_out"]  # post-LN: no ln_f
    assert axes["wte"]["w"] == ("vocab", "embed_proj") and axes["wpe"]["w"] == ("positions", "embed")
    assert axes["project_in"]["w"] == ("embed_proj", "embed")
    assert axes["blocks"][1]["mlp"]["fc"]["w"] == ("embed", "mlp")
    assert params["wpe"]["w"].shape == (32 + 2, 64)  # OPT's 2 offset rows


# Published parameter counts of the real sizes.
@pytest.mark.parametrize("name,count", [("125m", 125_239_296), ("350m", 331_196_416), ("1.3b", 1_315_758_080)])
def test_real_presets_have_published_sizes(name, count):
    model = models.opt(name)
    with torch.device("meta"):
        hf = transformers.OPTForCausalLM(model.hf_config())
    assert sum(p.numel() for p in hf.parameters()) == count
    assert cfx.tree.tree_size(cfx.eval_shape(model.init, cfx.random.key(0))) == count


def test_presets_and_configs():
    c = models.OPTConfig.preset("350m")
    assert (c.hidden_size, c.word_embed_proj_dim, c.do_layer_norm_before, c.projects) == (1024, 512, False, True)
    assert models.opt("125m").config.word_embed_proj_dim == 768 and not models.opt("1.3b").config.projects
    hf = small(**VARIANTS["post_ln_proj"]).hf_config()
    assert (hf.word_embed_proj_dim, hf.do_layer_norm_before, hf.activation_function, hf.pad_token_id) == \
        (32, False, "relu", 1)
    assert models.model_from_hf_config(hf).config == small(**VARIANTS["post_ln_proj"]).config
    with pytest.raises(ValueError, match=r"'13b'.*\['1.3b', '125m', '2.7b', '350m', '6.7b', 'tiny'\]"):
        models.opt("13b")
    with pytest.raises(ValueError, match="hidden_size=100 must be divisible by n_head=3"):
        models.opt("tiny", hidden_size=100, n_head=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        models.opt("tiny", activation="swiglu")
    with pytest.raises(ValueError, match=r"pad_token_id must be None or an id in \[0, vocab_size=96\)"):
        small(pad_token_id=96)
    with pytest.raises(ValueError, match="layer_norm_eps=1e-05 to exchange weights"):
        small(layer_norm_eps=1e-6).hf_config()
    bad = dict(small().hf_config().to_dict(), enable_bias=False)
    with pytest.raises(ValueError, match="enable_bias=False, which cfx.models.OPT does not implement"):
        models.model_from_hf_config(transformers.OPTConfig(**bad))


def test_dropout_is_keyed_and_map_blocks_routes_through_the_wrapper(hf_model):
    model, params = models.from_hf(hf_model)
    drop = dataclasses.replace(model, config=dataclasses.replace(model.config, dropout=0.2), blocks=None)
    tok = tokens(seed=4)
    k1, k2 = cfx.random.split(cfx.random.key(0))
    assert torch.equal(drop.apply(params, tok), model.apply(params, tok))  # key=None: no dropout
    a = drop.apply(params, tok, key=k1)
    assert torch.equal(a, drop.apply(params, tok, key=k1)) and not torch.allclose(a, drop.apply(params, tok, key=k2))
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Counting:
        inner: object

        def init(self, key):
            return self.inner.init(key)

        def apply(self, params, x, **kw):
            calls.append(x.shape)
            return self.inner.apply(params, x, **kw)

        def axes(self):
            return self.inner.axes()

    wrapped = model.map_blocks(Counting)
    assert torch.equal(wrapped.apply(params, tok), model.apply(params, tok))
    assert calls == [(3, 16, 64)] * 2 and isinstance(wrapped, models.OPT)


def test_bad_inputs_raise_value_errors(hf_model):
    model, params = models.from_hf(hf_model)
    tok = tokens()
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        model.apply(params, tokens(T=33))
    with pytest.raises(ValueError, match=r"\[0, vocab_size=96\)"):
        model.loss(params, tok, tok + 90)
    with pytest.raises(ValueError, match="mask"):
        model.apply(params, tok, mask=torch.ones(3, 16))
    with pytest.raises(ValueError, match="ln_f"):
        model.apply({k: v for k, v in params.items() if k != "ln_f"}, tok)
    with pytest.raises(ValueError, match="model="):
        models.from_hf(hf_model.state_dict())
    with pytest.raises(ValueError, match="unexpected keys.*layers.2"):
        models.from_hf(hf_opt(n_layer=3).state_dict(), model=model)
    with pytest.raises(ValueError, match="no 'lm_head.weight'"):
        models.from_hf(hf_model.model.state_dict(), model=small(tie_embeddings=False))
    split = model.with_layers(sequence=cfx.parallel.SequenceSplit("seq", "ring", "zigzag"))
    with pytest.raises(ValueError, match="padding mask under sequence parallelism.*Right-pad"):
        split.apply(params, tok, mask=torch.ones(3, 16, dtype=torch.bool))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_equals_single_device(variant):
    # Megatron blocks (pre- and post-LN), the vocab-parallel embedding, head and loss
    model = small(**VARIANTS[variant])
    params = model.init(cfx.random.key(0))
    tok = tokens(B=2, T=12, seed=5)
    targets = shifted_targets(tok)
    ref_loss, ref = cfx.value_and_grad(model.loss)(params, tok, targets)
    tp = tensor_parallel(model, "model")
    with cfx.Mesh({"model": 2}) as mesh:
        specs = cfx.Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        loss, grads = cfx.device_get(cfx.shard_map(cfx.value_and_grad(tp.loss), mesh=mesh, in_specs=(specs, P(), P()),
                                                   out_specs=(P(), specs))(params, tok, targets))
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("text", ["data=2,model=2", "seq=2", "pipe=2 microbatches=2"])
def test_plans_train_opt_like_one_device(text):
    # through the logical axes (Megatron rules), the offset positions of a ring's zigzag shares,
    # and the parts protocol (project_in with the embeddings, project_out with the tied head)
    model, tx = small(**VARIANTS["post_ln_proj"]), cfx.optim.sgd(0.3, momentum=0.9)  # linear in the grads
    seqs = cfx.random.randint(cfx.random.key(1), (2, 4, 13), 0, CFG["vocab_size"])
    batches = [(s[:, :-1], s[:, 1:]) for s in seqs]
    params, ref = model.init(cfx.random.key(0)), []
    state = tx.init(params)
    for x, y in batches:
        loss, g = cfx.value_and_grad(model.loss)(params, x, y)
        u, state = tx.update(g, state, params)
        params = cfx.optim.apply_updates(params, u)
        ref.append(loss)
    plan = Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        s, losses = step.init(cfx.random.key(0)), []
        for batch in batches:
            s, metrics = step(s, batch)
            losses.append(float(metrics["loss"]))
        got = step.params(s)
    torch.testing.assert_close(torch.tensor(losses), torch.stack(ref))
    cfx.tree.assert_tree_close(got, params)
