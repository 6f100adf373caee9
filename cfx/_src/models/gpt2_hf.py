"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel``: configs and state dicts.

HF's ``Conv1D`` weights are ``(in, out)`` like ``cfx.nn.Linear``, so only the fused ``c_attn``
needs work: it is ``[q | k | v]`` along the output dim.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models.common import check_params
from cfx._src.models.family import Family, PeftNames
from cfx._src.models.gpt2 import GPT2, GPT2Config, gpt2
from cfx._src.models.hf_state import StateDictReader, copy

_HF_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def config_from_hf(hf: Any) -> GPT2Config:
    """A ``GPT2Config`` from a ``transformers.GPT2Config``; ValueError for what cfx cannot express."""
    problems = []
    if hf.activation_function not in _HF_GELU_TANH:
        problems.append(f"activation_function={hf.activation_function!r} (cfx GPT-2 uses gelu_new)")
    if hf.n_inner not in (None, 4 * hf.n_embd):
        problems.append(f"n_inner={hf.n_inner} (cfx GPT-2 uses 4 * n_embd)")
    if not getattr(hf, "scale_attn_weights", True) or getattr(hf, "scale_attn_by_inverse_layer_idx", False):
        problems.append("non-standard attention scaling")
    if getattr(hf, "add_cross_attention", False):
        problems.append("add_cross_attention=True")
    if not getattr(hf, "tie_word_embeddings", True):
        problems.append("tie_word_embeddings=False")
    if problems:
        raise ValueError("cfx.models.from_hf: this GPT-2 config has " + "; ".join(problems)
                         + ", which cfx.models.GPT2 does not implement.")
    return GPT2Config(vocab_size=hf.vocab_size, n_positions=hf.n_positions, n_embd=hf.n_embd,
                      n_layer=hf.n_layer, n_head=hf.n_head, dropout=float(hf.resid_pdrop),
                      layer_norm_eps=float(hf.layer_norm_epsilon), init_std=float(hf.initializer_range))


def to_hf(model: GPT2, params: dict) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict (``lm_head.weight`` included, equal to ``wte``)."""
    check_params("cfx.models.to_hf", GPT2(model.config), params)
    sd = {"transformer.wte.weight": copy(params["wte"]["w"]),
          "transformer.wpe.weight": copy(params["wpe"]["w"])}
    for i, p in enumerate(params["blocks"]):
        pre = f"transformer.h.{i}."
        a = p["attn"]
        sd[pre + "ln_1.weight"] = copy(p["norm1"]["scale"])
        sd[pre + "ln_1.bias"] = copy(p["norm1"]["bias"])
        sd[pre + "attn.c_attn.weight"] = torch.cat([a[n]["w"] for n in "qkv"], dim=1).detach()  # (C, 3C)
        sd[pre + "attn.c_attn.bias"] = torch.cat([a[n]["b"] for n in "qkv"]).detach()  # (3C,)
        sd[pre + "attn.c_proj.weight"] = copy(a["o"]["w"])
        sd[pre + "attn.c_proj.bias"] = copy(a["o"]["b"])
        sd[pre + "ln_2.weight"] = copy(p["norm2"]["scale"])
        sd[pre + "ln_2.bias"] = copy(p["norm2"]["bias"])
        for hf_name, name in (("c_fc", "fc"), ("c_proj", "proj")):
            sd[pre + f"mlp.{hf_name}.weight"] = copy(p["mlp"][name]["w"])
            sd[pre + f"mlp.{hf_name}.bias"] = copy(p["mlp"][name]["b"])
    sd["transformer.ln_f.weight"] = copy(params["ln_f"]["scale"])
    sd["transformer.ln_f.bias"] = copy(params["ln_f"]["bias"])
    sd["lm_head.weight"] = copy(params["wte"]["w"])
    return sd


def from_hf_state_dict(model: GPT2, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """cfx params for ``model`` from a ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict."""
    c = model.config
    C, V = c.n_embd, c.vocab_size
    r = StateDictReader(state_dict, where="cfx.models.from_hf (GPT-2)", prefix="transformer.")
    params = {"wte": {"w": r.take("wte.weight", (V, C))},
              "wpe": {"w": r.take("wpe.weight", (c.n_positions, C))}, "blocks": []}
    for i in range(c.n_layer):
        pre = f"h.{i}."
        qkv_w = r.take(pre + "attn.c_attn.weight", (C, 3 * C))  # (C, 3C) = [q | k | v]
        qkv_b = r.take(pre + "attn.c_attn.bias", (3 * C,))
        attn = {n: {"w": copy(w), "b": copy(b)}
                for n, w, b in zip("qkv", qkv_w.split(C, dim=1), qkv_b.split(C))}
        attn["o"] = {"w": r.take(pre + "attn.c_proj.weight", (C, C)),
                     "b": r.take(pre + "attn.c_proj.bias", (C,))}
        params["blocks"].append({
            "norm1": {"scale": r.take(pre + "ln_1.weight", (C,)), "bias": r.take(pre + "ln_1.bias", (C,))},
            "attn": attn,
            "norm2": {"scale": r.take(pre + "ln_2.weight", (C,)), "bias": r.take(pre + "ln_2.bias", (C,))},
            "mlp": {"fc": {"w": r.take(pre + "mlp.c_fc.weight", (C, 4 * C)),
                           "b": r.take(pre + "mlp.c_fc.bias", (4 * C,))},
                    "proj": {"w": r.take(pre + "mlp.c_proj.weight", (4 * C, C)),
                             "b": r.take(pre + "mlp.c_proj.bias", (C,))}},
        })
    params["ln_f"] = {"scale": r.take("ln_f.weight", (C,)), "bias": r.take("ln_f.bias", (C,))}
    # The tied head, and the causal-mask buffers older checkpoints carry.
    r.finish(ignore=lambda k: k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias")))
    return params


FAMILY = Family(
    name="gpt2", model=GPT2, hf_model_types=("gpt2",), config_from_hf=config_from_hf, hf_config=GPT2.hf_config,
    to_hf=to_hf, from_hf=from_hf_state_dict, hf_classes=("GPT2LMHeadModel", "GPT2Model"), preset=gpt2,
    peft=PeftNames(block="transformer.h.{i}.",
                   linears={"attn.q+k+v": "attn.c_attn", "attn.o": "attn.c_proj", "mlp.fc": "mlp.c_fc",
                            "mlp.proj": "mlp.c_proj"},
                   fan_in_fan_out=True))  # HF's Conv1D holds (in, out) weights
