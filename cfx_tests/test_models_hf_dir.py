"""Hugging Face directories: what cfx.models.save_pretrained writes, transformers' from_pretrained
loads with the same logits; what transformers' save_pretrained writes (one file or sharded),
cfx.models.from_pretrained loads with the same logits, whole or onto a tensor-parallel mesh. cfx against
transformers in fp64 (the claim is the same function, which fp32 settles only up to each CPU's kernels)."""
from __future__ import annotations

import json

import pytest
import torch

import cfx
from cfx import P

V = 96


def tiny(name):
    if name == "gpt2":
        return cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_positions=32)
    if name == "llama":
        return cfx.models.llama("tiny", n_layer=2, vocab_size=V, max_position_embeddings=32)
    return cfx.models.opt("tiny", n_layer=2, vocab_size=V, max_position_embeddings=32)


NAMES = ["gpt2", "llama", "opt"]


def tokens():
    return cfx.random.randint(cfx.random.key(1), (2, 12), 0, V)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_saved_directories_load_in_transformers_with_the_same_logits(name, tmp_path):
    import transformers
    model = tiny(name)
    params = model.init(cfx.random.key(0))
    cfx.models.save_pretrained(tmp_path, model, params)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf.double()(x).logits, model.apply(cfx.tree.map(lambda t: t.double(), params), x))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shard", ["single", "sharded"])
def test_transformers_directories_load_into_cfx_with_the_same_logits(name, shard, tmp_path):
    import transformers
    cfg = tiny(name).hf_config()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if shard == "sharded" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard == "sharded")
    model, params = cfx.models.from_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.apply(cfx.tree.map(lambda t: t.double(), params), x), hf.double()(x).logits)


@pytest.mark.timeout(120)
def test_a_directory_loads_onto_a_tensor_parallel_mesh(tmp_path):
    model = tiny("llama")
    params = model.init(cfx.random.key(0))
    cfx.models.save_pretrained(tmp_path, model, params, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    with cfx.Mesh({"model": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        loaded, arrays = cfx.models.from_pretrained(tmp_path, mesh=mesh, specs=specs)
        q = arrays["blocks"][0]["attn"]["q"]["w"]
        assert isinstance(q, cfx.ShardedArray) and q.spec == specs["blocks"][0]["attn"]["q"]["w"]
        tp = cfx.parallel.tensor_parallel(loaded, "model")
        x = tokens()
        logits = cfx.shard_map(lambda p, x: cfx.lax.all_gather(tp.apply(p, x), "model", dim=-1, tiled=True),
                               mesh=mesh, in_specs=(specs, P()), out_specs=P())(arrays, x)
    torch.testing.assert_close(cfx.device_get(logits), model.apply(params, x))


def test_missing_pieces_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        cfx.models.from_pretrained(tmp_path)
    model = tiny("gpt2")
    cfx.models.save_pretrained(tmp_path, model, model.init(cfx.random.key(0)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        cfx.models.from_pretrained(tmp_path)
