"""OPT <-> Hugging Face ``OPTForCausalLM``: configs and state dicts.

HF ``nn.Linear`` weights are ``(out, in)``; cfx ``Linear`` weights are ``(in, out)``, so every
projection is transposed. A block's ``norm1`` is HF's ``self_attn_layer_norm`` and ``norm2`` its
``final_layer_norm`` (before the sub-layers in pre-LN, after the residual sums in post-LN); the
decoder's own ``final_layer_norm`` is cfx's ``ln_f``. ``embed_positions`` keeps its 2 offset rows.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models.common import check_params
from cfx._src.models.family import Family, PeftNames
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.models.opt import OPT, POSITION_OFFSET, OPTConfig, opt

_ATTN = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))
_MLP = (("fc", "fc1"), ("proj", "fc2"))
_NORMS = (("norm1", "self_attn_layer_norm"), ("norm2", "final_layer_norm"))
_DECODER = "model.decoder."
_FROM_HF_ACT = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(hf: Any) -> OPTConfig:
    """An ``OPTConfig`` from a ``transformers.OPTConfig``; ValueError for what cfx cannot express.

    Training-only settings cfx does not implement (``attention_dropout``, ``layerdrop``) are dropped:
    the logits of a model in ``eval()`` do not depend on them."""
    problems = []
    if hf.activation_function not in _FROM_HF_ACT:
        problems.append(f"activation_function={hf.activation_function!r} (cfx OPT takes {sorted(_FROM_HF_ACT)})")
    if not getattr(hf, "enable_bias", True):
        problems.append("enable_bias=False")
    if not getattr(hf, "layer_norm_elementwise_affine", True):
        problems.append("layer_norm_elementwise_affine=False")
    if hf.do_layer_norm_before and getattr(hf, "_remove_final_layer_norm", False):
        problems.append("_remove_final_layer_norm=True")
    if problems:
        raise ValueError("cfx.models.from_hf: this OPT config has " + "; ".join(problems)
                         + ", which cfx.models.OPT does not implement.")
    return OPTConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, n_layer=hf.num_hidden_layers,
        n_head=hf.num_attention_heads, ffn_dim=hf.ffn_dim, max_position_embeddings=hf.max_position_embeddings,
        word_embed_proj_dim=hf.word_embed_proj_dim or hf.hidden_size,
        do_layer_norm_before=bool(hf.do_layer_norm_before), activation=_FROM_HF_ACT[hf.activation_function],
        dropout=float(hf.dropout), tie_embeddings=bool(hf.tie_word_embeddings), pad_token_id=hf.pad_token_id,
        init_std=float(hf.init_std))


def _linear(p: dict) -> dict:
    out = {"weight": copy(p["w"].T)}  # (out, in)
    if "b" in p:
        out["bias"] = copy(p["b"])
    return out


def _norm(p: dict) -> dict:
    return {"weight": copy(p["scale"]), "bias": copy(p["bias"])}


def to_hf(model: OPT, params: dict) -> dict[str, torch.Tensor]:
    """An ``OPTForCausalLM`` state dict (with tied embeddings ``lm_head.weight`` equals ``wte``)."""
    check_params("cfx.models.to_hf", OPT(model.config), params)
    pre = _DECODER
    items: dict[str, dict] = {pre + "embed_tokens": {"weight": copy(params["wte"]["w"])},
                              pre + "embed_positions": {"weight": copy(params["wpe"]["w"])}}
    for name in ("project_in", "project_out"):
        if name in params:
            items[pre + name] = _linear(params[name])
    for i, p in enumerate(params["blocks"]):
        layer = f"{pre}layers.{i}."
        for name, hf_name in _ATTN:
            items[layer + "self_attn." + hf_name] = _linear(p["attn"][name])
        for name, hf_name in _MLP:
            items[layer + hf_name] = _linear(p["mlp"][name])
        for name, hf_name in _NORMS:
            items[layer + hf_name] = _norm(p[name])
    if "ln_f" in params:
        items[pre + "final_layer_norm"] = _norm(params["ln_f"])
    head = params["lm_head"]["w"].T if "lm_head" in params else params["wte"]["w"]
    items["lm_head"] = {"weight": copy(head)}  # (V, E)
    return {f"{k}.{n}": t for k, d in items.items() for n, t in d.items()}


def _prefix(state_dict: Mapping[str, torch.Tensor]) -> str:
    """``OPTForCausalLM`` keys start ``model.decoder.``, ``OPTModel``'s (and hub files') ``decoder.``."""
    for prefix in ("model.decoder.", "decoder."):
        if any(k.startswith(prefix) for k in state_dict):
            return prefix
    return ""


def from_hf_state_dict(model: OPT, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """cfx params for ``model`` from an ``OPTForCausalLM`` (or ``OPTModel``) state dict."""
    c = model.config
    C, E, V, F = c.hidden_size, c.word_embed_proj_dim, c.vocab_size, c.ffn_dim
    r = StateDictReader(state_dict, where="cfx.models.from_hf (OPT)", prefix=_prefix(state_dict))

    def linear(name: str, n_in: int, n_out: int, bias: bool = True) -> dict:
        out = {"w": r.take(name + ".weight", (n_out, n_in), transpose=True)}  # (in, out)
        if bias:
            out["b"] = r.take(name + ".bias", (n_out,))
        return out

    def norm(name: str) -> dict:
        return {"scale": r.take(name + ".weight", (C,)), "bias": r.take(name + ".bias", (C,))}

    params = {"wte": {"w": r.take("embed_tokens.weight", (V, E))},
              "wpe": {"w": r.take("embed_positions.weight", (c.max_position_embeddings + POSITION_OFFSET, C))}}
    if c.projects:
        params["project_in"] = linear("project_in", E, C, bias=False)
    params["blocks"] = []
    for i in range(c.n_layer):
        pre = f"layers.{i}."
        block = {"attn": {n: linear(pre + "self_attn." + h, C, C) for n, h in _ATTN},
                 "mlp": {"fc": linear(pre + "fc1", C, F), "proj": linear(pre + "fc2", F, C)}}
        block.update({n: norm(pre + h) for n, h in _NORMS})
        params["blocks"].append({k: block[k] for k in ("norm1", "attn", "norm2", "mlp")})
    if c.do_layer_norm_before:
        params["ln_f"] = norm("final_layer_norm")
    if c.projects:
        params["project_out"] = linear("project_out", C, E, bias=False)
    if not c.tie_embeddings:
        key = "lm_head.weight"
        if key not in state_dict:
            raise ValueError("cfx.models.from_hf (OPT): the state dict has no 'lm_head.weight' but the model has "
                             "untied embeddings; build it with tie_embeddings=True if the checkpoint ties them.")
        if tuple(state_dict[key].shape) != (V, E):
            raise ValueError(f"cfx.models.from_hf (OPT): 'lm_head.weight' has shape {tuple(state_dict[key].shape)}, "
                             f"expected {(V, E)}.")
        params["lm_head"] = {"w": copy(state_dict[key].T)}  # (E, V)
    r.finish(ignore=lambda k: k == "lm_head.weight")
    return params


FAMILY = Family(
    name="opt", model=OPT, hf_model_types=("opt",), config_from_hf=config_from_hf, hf_config=OPT.hf_config,
    to_hf=to_hf, from_hf=from_hf_state_dict, hf_classes=("OPTForCausalLM", "OPTModel"), preset=opt,
    peft=PeftNames(block=_DECODER + "layers.{i}.",
                   linears={**{f"attn.{n}": f"self_attn.{h}" for n, h in _ATTN}, **{f"mlp.{n}": h for n, h in _MLP}},
                   top={"lm_head": "lm_head", **{n: _DECODER + n for n in ("project_in", "project_out")}}))
