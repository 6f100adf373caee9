"""cfx.lora.save_peft / load_peft against peft's own directories (random weights, nothing downloaded):
what cfx saves, ``peft.PeftModel.from_pretrained`` loads onto the ``to_hf`` model with equal logits; what
peft saves, cfx loads with equal logits (compared in fp64: the claim is the same function, which fp32 settles
only up to each CPU's kernels)."""
import json

import pytest
import torch

import cfx
from cfx import models
from cfx_tests.hf_helpers import random_tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MODELS = {
    "gpt2": lambda: models.gpt2("tiny", vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "llama": lambda: models.llama("tiny", vocab_size=101, hidden_size=32, intermediate_size=48, n_layer=2, n_head=4,
                                  n_kv_heads=2, max_position_embeddings=32, tie_embeddings=False),
    "opt": lambda: models.opt("125m", vocab_size=99, hidden_size=32, ffn_dim=48, n_layer=2, n_head=4,
                              max_position_embeddings=32, word_embed_proj_dim=16),
}
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "opt": "OPTForCausalLM"}
QKV = (("q", "k", "v"),)
# (family, cfx config, peft's saved target_modules)
CASES = [
    ("gpt2", cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"), shared_a=QKV), ["c_attn", "c_fc", "c_proj"]),
    ("gpt2", cfx.lora.LoraConfig(r=2, alpha=3, targets=("qkv", "blocks.1.mlp.fc"), shared_a=QKV, rslora=True),
     ["c_attn", "transformer.h.1.mlp.c_fc"]),
    ("llama", cfx.lora.LoraConfig(r=4, alpha=16, targets=("attn", "mlp")),
     ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("llama", cfx.lora.LoraConfig(r=3, alpha=6, targets=("blocks.0.attn.[qv].w", "lm_head")),
     ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]),
    ("opt", cfx.lora.LoraConfig(r=4, alpha=8, targets=("all-linear",)),
     ["fc1", "fc2", "k_proj", "out_proj", "project_in", "project_out", "q_proj", "v_proj"]),
]


def trained(model, config, seed=0):
    """Adapters with every B moved off zero, as after training."""
    ad = cfx.lora.init(model, config, cfx.random.key(seed))
    return cfx.tree.map(lambda x: x if x.abs().max() > 0 else 0.2 * cfx.random.normal(cfx.random.key(seed + 1), x.shape),
                        ad)


def hf_of(family, model, params):
    hf = getattr(transformers, HF_CLASSES[family])(model.hf_config())
    hf.load_state_dict(models.to_hf(model, params), strict=True)
    return hf.eval()


def to64(tree):
    return cfx.tree.map(lambda x: x.double(), tree)


def tokens(model):
    return random_tokens(2, 12, model.config.vocab_size, seed=0)


@pytest.mark.parametrize("family,config,target_modules", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_save_peft_loads_in_peft_with_equal_logits(tmp_path, family, config, target_modules):
    model = MODELS[family]()
    params = model.init(cfx.random.key(0))
    adapters = trained(model, config)
    cfx.lora.save_peft(tmp_path, model, adapters, config)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] == target_modules and saved["r"] == config.r
    pm = peft.PeftModel.from_pretrained(hf_of(family, model, params), tmp_path).eval().double()
    tok = tokens(model)
    with torch.no_grad():
        ref = pm(input_ids=tok).logits
        with pm.disable_adapter():
            plain = pm(input_ids=tok).logits
    out = model.apply(cfx.lora.attach(to64(params), to64(adapters), config), tok)
    assert (ref - plain).abs().max() > 0.05  # the adapter was applied
    torch.testing.assert_close(out, ref)
    out = model.apply(cfx.lora.attach(params, adapters, config), tok)
    # and back: load_peft reads the same config and adapters
    back_config, back = cfx.lora.load_peft(tmp_path, model)
    assert (back_config.r, back_config.alpha, back_config.rslora, back_config.shared_a) == \
        (config.r, config.alpha, config.rslora, config.shared_a)
    cfx.tree.assert_close(back, adapters, rtol=0, atol=0)
    torch.testing.assert_close(model.apply(cfx.lora.attach(params, back, back_config), tok), out, rtol=0, atol=0)


@pytest.mark.parametrize("family,modules", [("gpt2", ["c_attn", "c_proj"]), ("llama", ["q_proj", "v_proj", "down_proj"]),
                                            ("opt", ["q_proj", "fc2"])])
def test_a_peft_saved_adapter_loads_into_cfx_with_equal_logits(tmp_path, family, modules):
    model = MODELS[family]()
    params = model.init(cfx.random.key(0))
    pm = peft.get_peft_model(hf_of(family, model, params),
                             peft.LoraConfig(r=4, lora_alpha=12, target_modules=modules, init_lora_weights=False,
                                             fan_in_fan_out=family == "gpt2"))
    pm.save_pretrained(tmp_path)
    config, adapters = cfx.lora.load_peft(tmp_path, model)
    assert (config.r, config.alpha, config.dropout) == (4, 12, 0.0)
    tok = tokens(model)
    with torch.no_grad():
        ref = pm.eval().double()(input_ids=tok).logits
    torch.testing.assert_close(model.apply(cfx.lora.attach(to64(params), to64(adapters), config), tok), ref)


def test_peft_interop_errors(tmp_path):
    model = MODELS["gpt2"]()
    apart = cfx.lora.LoraConfig(targets=("attn",))  # q, k, v each with its own A: no c_attn module holds that
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.k' has no module in peft's layout.*shared_a="):
        cfx.lora.save_peft(tmp_path, model, cfx.lora.init(model, apart, cfx.random.key(0)), apart)
    config = cfx.lora.LoraConfig(targets=("attn",), shared_a=QKV)
    with pytest.raises(ValueError, match=r"adapters \(make them with cfx\.lora\.init"):
        cfx.lora.save_peft(tmp_path, model, cfx.lora.init(model, cfx.lora.LoraConfig(targets=("mlp",)),
                                                          cfx.random.key(0)), config)
    with pytest.raises(ValueError, match=r"not a peft adapter directory"):
        cfx.lora.load_peft(tmp_path, model)
    cfx.lora.save_peft(tmp_path, model, cfx.lora.init(model, config, cfx.random.key(0)), config)
    llama, attn = MODELS["llama"](), cfx.lora.LoraConfig(targets=("attn",))
    cfx.lora.save_peft(tmp_path / "llama", llama, cfx.lora.init(llama, attn, cfx.random.key(0)), attn)
    with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.0.*no LoRA weight of a module cfx maps "
                                         r"for GPT2.*saved for another model"):
        cfx.lora.load_peft(tmp_path / "llama", model)
    meta = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**meta, "use_dora": True}))
    with pytest.raises(ValueError, match=r"use_dora=True.*which cfx\.lora does not implement"):
        cfx.lora.load_peft(tmp_path, model)
    bert = models.bert("tiny", n_layer=1, hidden_size=32, n_head=2, intermediate_size=64, vocab_size=50)
    with pytest.raises(ValueError, match=r"peft's layout is mapped for cfx\.models GPT2, Llama, Mixtral and OPT, "
                                         r"got Bert"):
        cfx.lora.save_peft(tmp_path, bert, cfx.lora.init(bert, attn, cfx.random.key(0)), attn)
