"""cfx.lora against peft on Hugging Face GPT-2 and Llama (random weights, nothing downloaded): the same
A and B give the same logits, five AdamW steps give the same adapters and losses, ``merge`` gives
``merge_and_unload``'s weights (in fp64: the claim is the same function, which fp32 settles only up to
each CPU's kernels); and the rest of the module's contract (int8 and bf16 bases, unmerge,
init's distribution, axes, errors)."""
import copy

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import models
from cfx_tests.budget import examples
from cfx_tests.hf_helpers import random_tokens, roughen, shifted_targets

transformers = pytest.importorskip("transformers")

GPT2_CFG = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
LLAMA_CFG = dict(vocab_size=101, hidden_size=32, intermediate_size=48, n_layer=2, n_head=4, n_kv_heads=2,
                 max_position_embeddings=32, tie_embeddings=False)
# peft's module names -> cfx's adapters of one block (GPT-2's c_attn is q, k, v with one A)
GPT2_MODULES = {"attn.c_attn": "attn.q+k+v", "attn.c_proj": "attn.o", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
LLAMA_MODULES = {**{f"self_attn.{c}_proj": f"attn.{c}" for c in "qkvo"},
                 **{f"mlp.{c}_proj": f"mlp.{c}" for c in ("gate", "up", "down")}}
GPT2_LORA = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"), shared_a=(("q", "k", "v"),))
LLAMA_LORA = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"))
# cfx's Adam takes its step size in fp32 for fp64 params too (optim/_util.py's bias corrections; the first
# step moves every B 2.2e-10 off torch's), which a gradient near eps = 1e-8 amplifies: measured 2.5e-7 (Llama,
# one element of blocks.1.mlp.down.A) over threads 1/2/4 and both xdist layouts; x12
ADAMW_FP64 = dict(rtol=0, atol=3e-6)


def peft():
    return pytest.importorskip("peft")


def hf_gpt2():
    torch.manual_seed(0)
    cfg = models.gpt2("tiny", **GPT2_CFG).hf_config()
    cfg._attn_implementation = "eager"
    return roughen(transformers.GPT2LMHeadModel(cfg), ("ln_1.weight", "ln_2.weight", "ln_f.weight")).eval()


def hf_llama():
    torch.manual_seed(0)
    cfg = models.llama("tiny", **LLAMA_CFG).hf_config()
    cfg._attn_implementation = "sdpa"  # fp64 throughout (Llama's eager attention takes its softmax in fp32)
    norms = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")
    return roughen(transformers.LlamaForCausalLM(cfg), norms).eval()


FAMILIES = {"gpt2": (hf_gpt2, GPT2_MODULES, GPT2_LORA, "transformer.h"),
            "llama": (hf_llama, LLAMA_MODULES, LLAMA_LORA, "model.layers")}


def peft_model(family, *, dropout=0.0, init=False, dtype=torch.float32):
    """The family's HF model under peft LoRA with r=4, alpha=8 on every attention and MLP Linear;
    ``init=False``: A and B both random (peft's ``init_lora_weights=False``), so B is nonzero."""
    make, table, _, _ = FAMILIES[family]
    cfg = peft().LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=init,
                            target_modules=sorted({m.rpartition(".")[2] for m in table}),
                            fan_in_fan_out=family == "gpt2")
    return peft().get_peft_model(make(), cfg).to(dtype)


def adapters_of(family, pm):
    """cfx adapters holding the peft model's A and B, read by hand: A = lora_A.T, B = lora_B.T (for
    c_attn, split in three column blocks q | k | v)."""
    make, table, _, layers = FAMILIES[family]
    blocks = []
    for layer in pm.get_submodule("base_model.model." + layers):
        block = {}
        for hf_name, cfx_name in table.items():
            mod = layer.get_submodule(hf_name)
            A = mod.lora_A["default"].weight.detach().T.clone()  # (in, r)
            B = mod.lora_B["default"].weight.detach().T.clone()  # (r, out)
            parent, name = cfx_name.split(".")
            if "+" in name:
                B = dict(zip("qkv", B.split(B.shape[1] // 3, dim=1)))
            block.setdefault(parent, {})[name] = {"A": A, "B": B}
        blocks.append(block)
    return {"blocks": blocks}


def cfx_side(family, pm):
    """(model, base params, adapters, config) equal to the peft model's."""
    model, params = models.from_hf(_base_state(pm), _cfx_model(family))
    return model, params, adapters_of(family, pm), FAMILIES[family][2]


def _cfx_model(family):
    return models.gpt2("tiny", **GPT2_CFG) if family == "gpt2" else models.llama("tiny", **LLAMA_CFG)


def _base_state(pm):
    """The peft model's base weights under the plain HF names (its LoRA tensors left out)."""
    sd = pm.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in sd.items() if ".lora_" not in k}


def tokens(family, seed=0, B=2, T=12):
    V = GPT2_CFG["vocab_size"] if family == "gpt2" else LLAMA_CFG["vocab_size"]
    return random_tokens(B, T, V, seed)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logits_equal_peft_with_the_same_a_and_b(family):
    pm = peft_model(family, dtype=torch.float64).eval()
    model, params, adapters, config = cfx_side(family, pm)
    tok = tokens(family)
    with torch.no_grad():
        ref = pm(input_ids=tok).logits
        with pm.disable_adapter():
            plain = pm(input_ids=tok).logits
    out = model.apply(cfx.lora.attach(params, adapters, config), tok)
    assert (ref - plain).abs().max() > 0.1  # the adapters move the logits: a wrong A or B shows
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_five_adamw_steps_equal_torch_adamw_on_peft(family):
    """In fp64 (in fp32 Adam turns rounding in near-zero gradients into lr-sized steps), the loss taken
    from the logits on both sides (both models' own losses take their softmax in fp32: hf_helpers):
    each step's loss at assert_close's fp64 defaults, the adapters after 5 within ``ADAMW_FP64``."""
    pm = peft_model(family, init=True, dtype=torch.float64)  # peft's own init: B = 0, as training starts
    pm.train()  # dropout 0: train mode changes nothing
    model, params, adapters, config = cfx_side(family, pm)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(FAMILIES[family][1]) * 2  # A and B per module, 2 blocks
    opt = torch.optim.AdamW(trainable, **hyper)
    tx = cfx.optim.adamw(hyper["lr"], b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
    state = tx.init(adapters)
    assert cfx.tree.size(state) == 2 * cfx.tree.size(adapters) + 1  # mu, nu (and a step count): adapters only
    ce = lambda logits, tok: torch.nn.functional.cross_entropy(logits.flatten(0, 1),  # noqa: E731
                                                               shifted_targets(tok).flatten())
    step = cfx.value_and_grad(lambda ad, tok: ce(model.apply(cfx.lora.attach(params, ad, config), tok), tok))
    for i in range(5):
        tok = tokens(family, seed=i)
        opt.zero_grad()
        ref = ce(pm(input_ids=tok).logits, tok)
        ref.backward()
        opt.step()
        loss, grads = step(adapters, tok)
        updates, state = tx.update(grads, state, adapters)
        adapters = cfx.optim.apply_updates(adapters, updates)
        torch.testing.assert_close(loss, ref.detach(), msg=lambda m, i=i: f"step {i}: {m}")
    cfx.tree.assert_close(adapters, adapters_of(family, pm), **ADAMW_FP64)
    assert adapters["blocks"][0]["mlp"][list(adapters["blocks"][0]["mlp"])[0]]["B"].abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_merge_equals_peft_merge_and_unload(family):
    pm = peft_model(family, dtype=torch.float64).eval()
    model, params, adapters, config = cfx_side(family, pm)
    tok = tokens(family, seed=3)
    merged = cfx.lora.merge(params, adapters, config)
    with torch.no_grad():
        ref_logits = pm(input_ids=tok).logits
        unloaded = pm.merge_and_unload()
    ref = unloaded.state_dict()
    mine = models.to_hf(model, merged)
    for k in mine:
        torch.testing.assert_close(mine[k], ref[k], msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(model.apply(merged, tok), ref_logits)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_unmerge_undoes_merge(family):
    pm = peft_model(family)
    _, params, adapters, config = cfx_side(family, pm)
    merged = cfx.lora.merge(params, adapters, config)
    assert not cfx.tree.allclose(merged, params)
    cfx.tree.assert_close(cfx.lora.unmerge(merged, adapters, config), params)


def _trained(model, config, seed=0):
    """Adapters with B moved off zero (as after training), so they change the logits."""
    adapters = cfx.lora.init(model, config, cfx.random.key(seed))
    return cfx.tree.map(lambda x: x if x.abs().max() > 0 else 0.1 * cfx.random.normal(cfx.random.key(seed + 1), x.shape),
                        adapters)


def test_int8_base_equals_dequantized_base_plus_adapters():
    model = _cfx_model("llama")
    params = model.init(cfx.random.key(0))
    adapters = _trained(model, LLAMA_LORA)
    q = cfx.quant.quantize(params, "int8", axes=model.axes(), min_size=0)
    assert isinstance(q["blocks"][0]["attn"]["q"]["w"], cfx.quant.QuantizedWeight)
    tok = tokens("llama")
    out = model.apply(cfx.lora.attach(q, adapters, LLAMA_LORA), tok)
    ref = model.apply(cfx.lora.attach(cfx.quant.dequantize(q), adapters, LLAMA_LORA), tok)
    # the kernel scales after its matmul, the reference multiplies the weights first: rounding only
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and the adapters train over the int8 base: gradients reach every A and B
    _, grads = cfx.value_and_grad(lambda ad: model.loss(cfx.lora.attach(q, ad, LLAMA_LORA), tok,
                                                        shifted_targets(tok)))(adapters)
    assert all(g.abs().max() > 0 for g in cfx.tree.leaves(grads))


def test_bf16_base_with_fp32_adapters_runs_close_to_fp32():
    model = _cfx_model("gpt2")
    params = model.init(cfx.random.key(0))
    adapters = _trained(model, GPT2_LORA)
    tok = tokens("gpt2")
    half = cfx.tree.map(lambda x: x.to(torch.bfloat16), params)
    out = model.apply(cfx.lora.attach(half, adapters, GPT2_LORA), tok)
    ref = model.apply(cfx.lora.attach(params, adapters, GPT2_LORA), tok)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)  # bf16's 8 bits, through 2 blocks
    loss, grads = cfx.value_and_grad(lambda ad: model.loss(cfx.lora.attach(half, ad, GPT2_LORA), tok,
                                                           shifted_targets(tok)))(adapters)
    assert {g.dtype for g in cfx.tree.leaves(grads)} == {torch.float32} and torch.isfinite(loss)


def test_adapters_change_nothing_until_b_moves():
    model = _cfx_model("gpt2")
    params = model.init(cfx.random.key(0))
    adapters = cfx.lora.init(model, GPT2_LORA, cfx.random.key(1))
    tok = tokens("gpt2")
    torch.testing.assert_close(model.apply(cfx.lora.attach(params, adapters, GPT2_LORA), tok),
                               model.apply(params, tok), rtol=0, atol=0)


@given(r=st.integers(1, 6), rslora=st.booleans(), alpha=st.sampled_from([1.0, 8.0, 16.0]))
@examples(ci=4)
def test_a_layer_computes_base_plus_scaled_low_rank_term(r, rslora, alpha):
    config = cfx.lora.LoraConfig(r=r, alpha=alpha, targets=("attn",), rslora=rslora)
    lin = cfx.nn.Linear(12, 20)
    p = cfx.tree.map(lambda t: t.double(), lin.init(cfx.random.key(0)))  # fp64: the formula, not fp32's rounding
    A, B = (cfx.random.normal(cfx.random.key(k), s).double() for k, s in ((1, (12, r)), (2, (r, 20))))
    w = cfx.lora.LoraWeight(p["w"], A, B, config.scale)
    x = cfx.random.normal(cfx.random.key(3), (3, 5, 12)).double()
    scale = alpha / (r ** 0.5 if rslora else r)
    ref = x @ (p["w"] + scale * A @ B) + p["b"]
    torch.testing.assert_close(lin.apply({**p, "w": w}, x), ref)


def test_dropout_on_the_adapter_input_follows_the_key():
    model = _cfx_model("llama")
    params = model.init(cfx.random.key(0))
    config = cfx.lora.LoraConfig(r=4, alpha=8, dropout=0.5, targets=("attn", "mlp"))
    adapters = _trained(model, config)
    tok = tokens("llama")
    run = lambda key: model.apply(cfx.lora.attach(params, adapters, config, key=key), tok)  # noqa: E731
    k = cfx.random.key(7)
    torch.testing.assert_close(run(k), run(k), rtol=0, atol=0)
    assert (run(k) - run(cfx.random.key(8))).abs().max() > 1e-3
    assert (run(k) - run(None)).abs().max() > 1e-3  # None: no dropout, evaluation


def test_init_draws_a_as_peft_does_and_b_zero():
    """A ~ U(-1/sqrt(in), 1/sqrt(in)), peft's kaiming_uniform(a=sqrt(5)) on lora_A (r, in)."""
    model = models.llama("tiny", **{**LLAMA_CFG, "hidden_size": 256, "intermediate_size": 64, "n_layer": 1})
    config = cfx.lora.LoraConfig(r=64, targets=("blocks.0.attn.q.w",))
    ad = cfx.lora.init(model, config, cfx.random.key(0))
    A, B = ad["blocks"][0]["attn"]["q"]["A"], ad["blocks"][0]["attn"]["q"]["B"]
    assert A.shape == (256, 64) and B.shape == (64, 256) and not B.any() and A.dtype == torch.float32
    bound = 256 ** -0.5
    lin = peft().get_peft_model(torch.nn.Sequential(torch.nn.Linear(256, 256)),
                                peft().LoraConfig(r=64, target_modules=["0"]))
    theirs = lin.base_model.model[0].lora_A["default"].weight  # (r, in)
    for a in (A, theirs.detach()):
        assert a.abs().max() <= bound and abs(a.std().item() - bound / 3 ** 0.5) < 0.02 * bound
    torch.testing.assert_close(cfx.lora.init(model, config, cfx.random.key(0)), ad, rtol=0, atol=0)
    assert not torch.equal(cfx.lora.init(model, config, cfx.random.key(1))["blocks"][0]["attn"]["q"]["A"], A)


def test_targets_presets_patterns_and_axes():
    model = _cfx_model("llama")
    every = cfx.tree.leaf_paths(cfx.lora.init(model, cfx.lora.LoraConfig(targets=("all-linear",)), cfx.random.key(0)))
    assert "lm_head.A" not in every and "blocks.1.mlp.down.B" in every and len(every) == 2 * 7 * 2
    qv = cfx.lora.init(model, cfx.lora.LoraConfig(targets=("blocks.*.attn.[qv]",)), cfx.random.key(0))
    assert cfx.tree.leaf_paths(qv) == [f"blocks.{i}.attn.{n}.{m}" for i in (0, 1) for n in "qv" for m in "AB"]
    head = cfx.lora.init(model, cfx.lora.LoraConfig(targets=("lm_head.w",)), cfx.random.key(0))
    assert cfx.tree.leaf_paths(head) == ["lm_head.A", "lm_head.B"]
    one = cfx.lora.init(model, cfx.lora.LoraConfig(targets=("blocks.1.mlp.up",)), cfx.random.key(0))
    assert one["blocks"][0] == {} and list(one["blocks"][1]["mlp"]) == ["up"]
    axes = cfx.lora.axes(model, LLAMA_LORA)
    assert axes["blocks"][0]["attn"]["k"] == {"A": ("embed", None), "B": (None, "kv_heads")}
    assert axes["blocks"][0]["mlp"]["down"] == {"A": ("mlp", None), "B": (None, "embed")}
    shapes = cfx.tree.map(lambda x: 0, cfx.lora.init(model, LLAMA_LORA, cfx.random.key(0)))
    assert cfx.tree.structure(shapes) == cfx.tree.structure(
        cfx.tree.map(lambda a: 0, axes, is_leaf=cfx.tree.is_axes_leaf))


def test_errors_name_the_leaf_and_the_fix():
    model = _cfx_model("gpt2")
    params = model.init(cfx.random.key(0))
    with pytest.raises(ValueError, match=r"no leaf matched the targets \('blocks\.\*\.attn\.wq',\).*blocks\.0\.attn"):
        cfx.lora.init(model, cfx.lora.LoraConfig(targets=("blocks.*.attn.wq",)), cfx.random.key(0))
    with pytest.raises(ValueError, match=r"'wte\.w'.*not a 2-D Linear weight"):
        cfx.lora.init(model, cfx.lora.LoraConfig(targets=("wte.w",)), cfx.random.key(0))
    with pytest.raises(ValueError, match=r"'blocks\.0\.norm1\.scale'.*not a 2-D Linear weight.*end in '\.w'"):
        cfx.lora.init(model, cfx.lora.LoraConfig(targets=("blocks.0.norm1.scale",)), cfx.random.key(0))
    with pytest.raises(ValueError, match=r"shared_a group \('q', 'k', 'v'\) under 'blocks\.0\.attn'.*blocks\.0\.attn\.k\.w"):
        cfx.lora.init(model, cfx.lora.LoraConfig(targets=("*.q", "*.v"), shared_a=(("q", "k", "v"),)),
                      cfx.random.key(0))
    adapters = cfx.lora.init(model, GPT2_LORA, cfx.random.key(0))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q\+k\+v\.A has shape \(32, 4\), expected \(in, r=8\)"):
        cfx.lora.attach(params, adapters, cfx.lora.LoraConfig(r=8, targets=("attn",)))
    other = models.gpt2("tiny", **{**GPT2_CFG, "n_embd": 64})
    with pytest.raises(ValueError, match=r"adapter 'blocks\.0\.attn\.q\+k\+v'.*does not fit blocks\.0\.attn\.q\.w of shape \(64, 64\)"):
        cfx.lora.attach(other.init(cfx.random.key(0)), adapters, GPT2_LORA)
    deeper = models.gpt2("tiny", **{**GPT2_CFG, "n_layer": 3})
    with pytest.raises(ValueError, match=r"part ways at 'blocks'.*another structure"):
        cfx.lora.attach(params, cfx.lora.init(deeper, GPT2_LORA, cfx.random.key(0)), GPT2_LORA)
    with pytest.raises(ValueError, match=r"part ways at 'blocks\.0\.attn\.qq'"):
        cfx.lora.attach(params, {"blocks": [{"attn": {"qq": {"A": 1}}}, {}]}, GPT2_LORA)
    once = cfx.lora.attach(params, adapters, GPT2_LORA)
    with pytest.raises(ValueError, match=r"already carries an adapter"):
        cfx.lora.attach(once, adapters, GPT2_LORA)
    q = cfx.quant.quantize(params, "int8", axes=model.axes(), min_size=0)
    with pytest.raises(ValueError, match=r"QuantizedWeight; merge into floating-point params"):
        cfx.lora.merge(q, adapters, GPT2_LORA)
    for bad in (dict(r=0), dict(alpha=-1.0), dict(dropout=1.0), dict(targets="attn"), dict(targets=()),
                dict(shared_a=("q", "k")), dict(shared_a=(("q", "k"), ("k", "v")))):
        with pytest.raises(ValueError, match=r"cfx\.lora\.LoraConfig: "):
            cfx.lora.LoraConfig(**bad)


def test_params_with_adapters_pass_the_models_checks():
    model = _cfx_model("llama")
    params = model.init(cfx.random.key(0))
    attached = cfx.lora.attach(params, cfx.lora.init(model, LLAMA_LORA, cfx.random.key(1)), LLAMA_LORA)
    paths = cfx.tree.leaf_paths(attached)
    assert "blocks.0.attn.q.w.base" in paths and "blocks.0.attn.q.w.A" in paths
    bad = copy.copy(attached)
    bad["blocks"] = attached["blocks"][:1]
    with pytest.raises(ValueError, match=r"missing leaves \['blocks\.1\."):
        model.apply(bad, tokens("llama"))


def test_config_parse_reads_a_command_lines_text():
    parse = cfx.lora.LoraConfig.parse
    assert parse("r=4,alpha=8") == cfx.lora.LoraConfig(r=4, alpha=8.0)
    assert parse(" r=2 , targets=unet-attn+*.ff.proj,dropout=0.1,rslora=1", targets=("attn",)) == \
        cfx.lora.LoraConfig(r=2, targets=("unet-attn", "*.ff.proj"), dropout=0.1, rslora=True)
    assert parse("r=2", targets=("unet-attn",)).targets == ("unet-attn",)  # a default for keys not given
    assert parse("targets=attn+mlp,shared_a=q+k+v/gate+up").shared_a == (("q", "k", "v"), ("gate", "up"))
    for text, says in [("r=4,r=8", "each KEY once"), ("r4", "expected comma-separated KEY=VALUE"),
                       ("rank=4", "from \\['alpha', 'dropout', 'r', 'rslora', 'shared_a', 'targets'\\]"),
                       ("r=1.5", "r='1.5' is not a valid r"), ("rslora=yes", "rslora='yes' is not a valid rslora"),
                       ("alpha=-2", "alpha must be a positive number")]:
        with pytest.raises(ValueError, match=f"^--lora {text!r}: .*{says}"):
            parse(text)
    with pytest.raises(ValueError, match=r"^--adapter: r must be a positive int"):
        parse("r=0", where="--adapter")
