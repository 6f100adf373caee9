"""Llama <-> Hugging Face ``LlamaForCausalLM``: configs and state dicts.

HF ``nn.Linear`` weights are ``(out, in)``; cfx ``Linear`` weights are ``(in, out)``, so every
projection is transposed. HF's q/k rows already follow the ``rotate_half`` RoPE layout cfx uses.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cfx._src.models.common import check_params
from cfx._src.models.family import Family, PeftNames
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.models.llama import Llama, LlamaConfig, llama

_ATTN = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"))
_MLP = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
BLOCK = "model.layers.{i}."


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None)  # transformers 5.x
    if params is None:  # 4.x: rope_theta plus an optional rope_scaling dict
        params = dict(getattr(hf, "rope_scaling", None) or {}, rope_theta=getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"cfx.models.from_hf: RoPE type {kind!r} is not implemented (only 'default'); "
                         "cfx.models.Llama would compute different logits.")
    return float(params["rope_theta"])


def config_from_hf(hf: Any) -> LlamaConfig:
    """A ``LlamaConfig`` from a ``transformers.LlamaConfig``; ValueError for what cfx cannot express."""
    problems = []
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r} (cfx Llama uses silu)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        problems.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if problems:
        raise ValueError("cfx.models.from_hf: this Llama config has " + "; ".join(problems)
                         + ", which cfx.models.Llama does not implement.")
    return LlamaConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        n_layer=hf.num_hidden_layers, n_head=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads, rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.rms_norm_eps), max_position_embeddings=hf.max_position_embeddings,
        tie_embeddings=bool(hf.tie_word_embeddings), init_std=float(hf.initializer_range))


def _mlp_to_hf(sd: dict, pre: str, p: dict) -> None:
    for name, hf_name in _MLP:
        sd[pre + f"mlp.{hf_name}.weight"] = copy(p[name]["w"].T)  # (out, in)


def _mlp_from_hf(r: StateDictReader, pre: str, c: LlamaConfig) -> dict:
    C, F = c.hidden_size, c.intermediate_size
    shapes = {"gate": (F, C), "up": (F, C), "down": (C, F)}  # HF's (out, in)
    return {n: {"w": r.take(pre + f"mlp.{h}.weight", shapes[n], transpose=True)} for n, h in _MLP}


def to_hf(model: Llama, params: dict, *, mlp: Callable[[dict, str, dict], None] = _mlp_to_hf
          ) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict (with tied embeddings ``lm_head.weight`` equals the embedding);
    ``mlp(sd, prefix, block_mlp_params)`` writes a block's MLP (Mixtral's writes its experts)."""
    check_params("cfx.models.to_hf", type(model)(model.config), params)
    sd = {"model.embed_tokens.weight": copy(params["embed"]["w"])}
    for i, p in enumerate(params["blocks"]):
        pre = BLOCK.format(i=i)
        for name, hf_name in _ATTN:
            sd[pre + f"self_attn.{hf_name}.weight"] = copy(p["attn"][name]["w"].T)  # (out, in)
        mlp(sd, pre, p["mlp"])
        sd[pre + "input_layernorm.weight"] = copy(p["norm1"]["scale"])
        sd[pre + "post_attention_layernorm.weight"] = copy(p["norm2"]["scale"])
    sd["model.norm.weight"] = copy(params["norm"]["scale"])
    head = params["embed"]["w"] if model.config.tie_embeddings else params["lm_head"]["w"].T
    sd["lm_head.weight"] = copy(head)  # (V, C)
    return sd


def from_hf_state_dict(model: Llama, state_dict: Mapping[str, torch.Tensor], *,
                       mlp: Callable[[StateDictReader, str, Any], dict] = _mlp_from_hf) -> dict:
    """cfx params for ``model`` from a ``LlamaForCausalLM`` (or ``LlamaModel``) state dict;
    ``mlp(reader, prefix, config)`` reads a block's MLP (Mixtral's reads its experts)."""
    c = model.config
    C, V, D = c.hidden_size, c.vocab_size, c.head_dim
    where = f"cfx.models.from_hf ({type(model).__name__})"
    r = StateDictReader(state_dict, where=where, prefix="model.")
    # HF (out, in) shapes of each projection.
    attn_shapes = {"q": (c.n_head * D, C), "k": (c.n_kv_heads * D, C), "v": (c.n_kv_heads * D, C),
                   "o": (C, c.n_head * D)}
    params = {"embed": {"w": r.take("embed_tokens.weight", (V, C))}, "blocks": []}
    for i in range(c.n_layer):
        pre = f"layers.{i}."
        attn = {n: {"w": r.take(pre + f"self_attn.{h}.weight", attn_shapes[n], transpose=True)}
                for n, h in _ATTN}  # (in, out)
        params["blocks"].append({
            "norm1": {"scale": r.take(pre + "input_layernorm.weight", (C,))},
            "attn": attn,
            "norm2": {"scale": r.take(pre + "post_attention_layernorm.weight", (C,))},
            "mlp": mlp(r, pre, c),
        })
    params["norm"] = {"scale": r.take("norm.weight", (C,))}
    if not c.tie_embeddings:
        key = "lm_head.weight"
        if key not in state_dict:
            raise ValueError(f"{where}: the state dict has no 'lm_head.weight' but the "
                             "model has untied embeddings; build it with tie_embeddings=True if the "
                             "checkpoint ties them.")
        if tuple(state_dict[key].shape) != (V, C):
            raise ValueError(f"{where}: 'lm_head.weight' has shape "
                             f"{tuple(state_dict[key].shape)}, expected {(V, C)}.")
        params["lm_head"] = {"w": copy(state_dict[key].T)}  # (C, V)
    r.finish(ignore=lambda k: k == "lm_head.weight" or k.endswith("rotary_emb.inv_freq"))
    return params


# peft's Linears, Mixtral's too (its experts are no Linears: peft adapts its attention and head)
PEFT = PeftNames(block=BLOCK, linears={**{f"attn.{n}": f"self_attn.{h}" for n, h in _ATTN},
                                       **{f"mlp.{n}": f"mlp.{h}" for n, h in _MLP}},
                 top={"lm_head": "lm_head"})
FAMILY = Family(
    name="llama", model=Llama, hf_model_types=("llama",), config_from_hf=config_from_hf, hf_config=Llama.hf_config,
    to_hf=to_hf, from_hf=from_hf_state_dict, hf_classes=("LlamaForCausalLM", "LlamaModel"), preset=llama, peft=PEFT)
