"""The family records (``cfx._src.models.families.FAMILIES``): every family's weights and configs go to
Hugging Face and back unchanged, its three lookups (by model, by ``model_type``, by the training job's
name) agree, and a new record in the tuple is found by every reader -- Hugging Face interop, peft's
adapter directories, the training job -- without editing them."""
import json
import types

import pytest

import cfx
from cfx._src.models import families, gpt2_hf
from cfx._src.models.family import Family, PeftNames
from cfx._src.models.gpt2 import GPT2, GPT2Config
from cfx._src.train.cli_train import parse_args
from cfx._src.train.config import TrainConfig
from cfx._src.train.data import VOCAB_SIZE
from cfx._src.train.model import build_model

transformers = pytest.importorskip("transformers")

V = 64
# tiny models of every family, each of its variants (a family added to FAMILIES adds its row here)
TINY = {
    "gpt2": lambda: [cfx.models.gpt2("tiny", n_layer=2, n_embd=32, vocab_size=V, n_positions=16)],
    "llama": lambda: [cfx.models.llama("tiny", n_layer=2, hidden_size=32, intermediate_size=48, n_head=4, n_kv_heads=2,
                                       vocab_size=V, max_position_embeddings=16, tie_embeddings=tie)
                      for tie in (True, False)],
    "mixtral": lambda: [cfx.models.mixtral("tiny", n_layer=2, hidden_size=32, intermediate_size=48, n_head=4,
                                           n_kv_heads=2, n_experts=4, vocab_size=V, max_position_embeddings=16)],
    "bert": lambda: [cfx.models.bert("tiny", n_layer=2, hidden_size=32, n_head=2, intermediate_size=64, vocab_size=V,
                                     max_position_embeddings=16, head=head, num_labels=3 if head == "classify" else 2)
                     for head in ("mlm", "classify")],
    "opt": lambda: [cfx.models.opt("tiny", n_layer=2, hidden_size=32, ffn_dim=48, n_head=4, vocab_size=V,
                                   max_position_embeddings=16, word_embed_proj_dim=e) for e in (32, 16)],
    "vit": lambda: [cfx.models.vit("tiny", image_size=8, patch_size=4, hidden_size=16, n_head=2, n_layer=2,
                                   intermediate_size=32, num_labels=3)],
}
NAMES = [f.name for f in families.FAMILIES]


def family(name):
    return next(f for f in families.FAMILIES if f.name == name)


def test_every_family_has_a_tiny_model_here():
    assert sorted(NAMES) == sorted(TINY), "add a tiny model of each new family to TINY"
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_weights_and_configs_round_trip_through_hugging_face(name):
    fam = family(name)
    for i, model in enumerate(TINY[name]()):
        params = model.init(cfx.random.key(i))
        state = fam.to_hf(model, params)
        assert cfx.tree.allclose(fam.from_hf(model, state), params, rtol=0, atol=0)
        assert state.keys() == cfx.models.to_hf(model, params).keys()
        hf_config = fam.hf_config(model)
        assert hf_config.model_type in fam.hf_model_types
        back = fam.build(hf_config, fam.head_of([fam.hf_class(model)]))
        assert type(back) is fam.model and back.config == model.config
        assert cfx.models.model_from_hf_config(hf_config, head=getattr(model.config, "head", "mlm")).config == model.config
        # the record's HF class is transformers' own, and holds exactly those weights
        assert fam.hf_class(model) in fam.hf_classes and all(hasattr(transformers, c) for c in fam.hf_classes)
        getattr(transformers, fam.hf_class(model))(hf_config).load_state_dict(state, strict=True)


@pytest.mark.parametrize("name", NAMES)
def test_the_lookups_agree(name):
    fam = family(name)
    for model in TINY[name]():
        assert families.find(model) is fam and families.of_model(model, "here") is fam  # a Mixtral is no Llama
    for kind in fam.hf_model_types:
        assert families.of_model_type(kind, "here") is fam
    if fam.preset is None:
        assert name not in families.trained()
        with pytest.raises(ValueError, match=f"here: unknown model '{name}'; choose gpt2, llama, mixtral or opt"):
            families.named(name, "here")
    else:
        assert families.named(name, "here") is fam and type(fam.preset("tiny")) is fam.model


def test_what_no_family_holds_is_refused_naming_the_families():
    with pytest.raises(ValueError, match=r"here: expected a cfx\.models\.GPT2, Llama, Mixtral, Bert, OPT or ViT, "
                                         r"got object"):
        families.of_model(object(), "here")
    with pytest.raises(ValueError, match="model_type 't5' is not supported; cfx converts 'gpt2', 'llama', 'mixtral', "
                                         "'bert', 'opt' and 'vit' checkpoints"):
        cfx.models.model_from_hf_config(types.SimpleNamespace(model_type="t5"))
    gpt2 = TINY["gpt2"]()[0]
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification is not supported; cfx converts GPT2LMHeadModel "
                                         "and GPT2Model"):
        cfx.models.from_hf(transformers.GPT2ForSequenceClassification(gpt2.hf_config()))


# A new family: GPT-2's layers under names of its own (a subclass, so the nearest class must win)
class Toy(GPT2):
    pass


class ToyForCausalLM:
    """An HF model of the toy family, as ``from_hf`` sees one: a config and a state dict."""

    def __init__(self, config, state):
        self.config, self._state = config, state

    def state_dict(self):
        return self._state


TOY = Family(
    name="toy", model=Toy, hf_model_types=("toy",), config_from_hf=lambda hf: hf.cfx_config,
    hf_config=lambda model: types.SimpleNamespace(model_type="toy", cfx_config=model.config),
    to_hf=lambda model, params: {"toy." + k: v for k, v in gpt2_hf.to_hf(model, params).items()},
    from_hf=lambda model, sd: gpt2_hf.from_hf_state_dict(model, {k.removeprefix("toy."): v for k, v in sd.items()}),
    hf_classes=("ToyForCausalLM",), preset=lambda preset, **kw: Toy(GPT2Config.preset(preset, **kw)),
    peft=PeftNames(block="toy.layers.{i}.", linears={"attn.q": "attn.query", "attn.v": "attn.value",
                                                     "mlp.fc": "mlp.up"}))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, TOY))
    return TOY.preset("tiny", n_layer=2, n_embd=32, vocab_size=V, n_positions=16)


def test_a_new_record_is_read_by_hugging_face_interop(toy):
    params = toy.init(cfx.random.key(0))
    state = cfx.models.to_hf(toy, params)
    assert "toy.transformer.wte.weight" in state and all(k.startswith("toy.") for k in state)
    config = cfx.models.hf_config(toy)
    assert config.model_type == "toy" and cfx.models.model_from_hf_config(config).config == toy.config
    model, back = cfx.models.from_hf(ToyForCausalLM(config, state))
    assert type(model) is Toy and cfx.tree.allclose(back, params, rtol=0, atol=0)
    assert cfx.tree.allclose(cfx.models.from_hf(state, toy)[1], params, rtol=0, atol=0)
    with pytest.raises(ValueError, match="SimpleNamespace is not supported; cfx converts ToyForCausalLM"):
        cfx.models.from_hf(types.SimpleNamespace(config=config, state_dict=lambda: state))


def test_a_new_record_is_read_by_peft_directories(toy, tmp_path):
    from safetensors import safe_open

    config = cfx.lora.LoraConfig(r=2, alpha=4, targets=("blocks.*.attn.[qv].w", "blocks.*.mlp.fc.w"))
    adapters = cfx.tree.map(lambda x: x + 0.1, cfx.lora.init(toy, config, cfx.random.key(0)))
    cfx.lora.save_peft(tmp_path, toy, adapters, config)
    with safe_open(tmp_path / "adapter_model.safetensors", framework="pt") as f:
        modules = {k.rpartition(".lora_")[0] for k in f.keys()}
    assert modules == {f"base_model.model.toy.layers.{i}.{m}" for i in range(2)
                       for m in ("attn.query", "attn.value", "mlp.up")}
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["query", "up", "value"] and saved["fan_in_fan_out"] is False
    back_config, back = cfx.lora.load_peft(tmp_path, toy)
    assert back_config.r == 2 and cfx.tree.allclose(back, adapters, rtol=0, atol=0)
    k = cfx.lora.LoraConfig(r=2, targets=("blocks.0.attn.k.w",))
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.k' has no module in peft's layout of Toy"):
        cfx.lora.save_peft(tmp_path, toy, cfx.lora.init(toy, k, cfx.random.key(0)), k)


def test_a_new_record_is_read_by_the_training_job(toy):
    assert "toy" in families.trained() and parse_args(["--model", "toy"]).model == "toy"
    model = build_model(TrainConfig(model="toy", preset="tiny,n_layer=1", seq=16))
    assert type(model) is Toy and model.config.vocab_size == VOCAB_SIZE and model.config.n_layer == 1


def test_the_training_job_refuses_a_family_it_does_not_train():
    with pytest.raises(ValueError, match="--model: unknown model 'bert'; choose gpt2, llama, mixtral or opt"):
        build_model(TrainConfig(model="bert"))
