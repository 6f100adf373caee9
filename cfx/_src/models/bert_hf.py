"""BERT <-> Hugging Face ``BertForMaskedLM`` / ``BertForSequenceClassification``: configs and
state dicts.

HF ``nn.Linear`` weights are ``(out, in)``; cfx ``Linear`` weights are ``(in, out)``, so every
projection is transposed. A block's ``norm1`` is HF's ``attention.output.LayerNorm`` and
``norm2`` its ``output.LayerNorm`` (post-norm: each follows its residual sum).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models.bert import Bert, BertConfig
from cfx._src.models.common import check_params
from cfx._src.models.family import Family
from cfx._src.models.hf_state import StateDictReader, copy

_ATTN = (("q", "attention.self.query"), ("k", "attention.self.key"), ("v", "attention.self.value"),
         ("o", "attention.output.dense"))
_MLP = (("fc", "intermediate.dense"), ("proj", "output.dense"))
_NORMS = (("norm1", "attention.output.LayerNorm"), ("norm2", "output.LayerNorm"))


def config_from_hf(hf: Any, head: str) -> BertConfig:
    """A ``BertConfig`` from a ``transformers.BertConfig``; ValueError for what cfx cannot express."""
    problems = []
    if hf.hidden_act != "gelu":
        problems.append(f"hidden_act={hf.hidden_act!r} (cfx BERT uses exact gelu)")
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type={hf.position_embedding_type!r}")
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        problems.append("a decoder / cross-attention configuration")
    if problems:
        raise ValueError("cfx.models.from_hf: this BERT config has " + "; ".join(problems)
                         + ", which cfx.models.Bert does not implement.")
    return BertConfig(vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
                      type_vocab_size=hf.type_vocab_size, hidden_size=hf.hidden_size, n_layer=hf.num_hidden_layers,
                      n_head=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
                      dropout=float(hf.hidden_dropout_prob), layer_norm_eps=float(hf.layer_norm_eps),
                      init_std=float(hf.initializer_range), head=head,
                      num_labels=int(hf.num_labels) if head == "classify" else 2)


def _linear(p: dict) -> dict:
    return {"weight": copy(p["w"].T), "bias": copy(p["b"])}


def _norm(p: dict) -> dict:
    return {"weight": copy(p["scale"]), "bias": copy(p["bias"])}


def to_hf(model: Bert, params: dict) -> dict[str, torch.Tensor]:
    """A ``BertForMaskedLM`` / ``BertForSequenceClassification`` state dict (the tied decoder
    weight and bias included)."""
    check_params("cfx.models.to_hf", Bert(model.config), params)
    items: dict[str, dict] = {
        "bert.embeddings.word_embeddings": {"weight": copy(params["wte"]["w"])},
        "bert.embeddings.position_embeddings": {"weight": copy(params["wpe"]["w"])},
        "bert.embeddings.token_type_embeddings": {"weight": copy(params["wtt"]["w"])},
        "bert.embeddings.LayerNorm": _norm(params["ln_e"]),
    }
    for i, p in enumerate(params["blocks"]):
        pre = f"bert.encoder.layer.{i}."
        for name, hf_name in _ATTN:
            items[pre + hf_name] = _linear(p["attn"][name])
        for name, hf_name in _MLP:
            items[pre + hf_name] = _linear(p["mlp"][name])
        for name, hf_name in _NORMS:
            items[pre + hf_name] = _norm(p[name])
    if model.config.head == "mlm":
        h = params["mlm"]
        items["cls.predictions.transform.dense"] = _linear(h["dense"])
        items["cls.predictions.transform.LayerNorm"] = _norm(h["ln"])
        items["cls.predictions.decoder"] = {"weight": copy(params["wte"]["w"]), "bias": copy(h["b"])}
        items["cls.predictions"] = {"bias": copy(h["b"])}
    else:
        items["bert.pooler.dense"] = _linear(params["pooler"])
        items["classifier"] = _linear(params["classifier"])
    return {f"{k}.{n}": t for k, d in items.items() for n, t in d.items()}


def from_hf_state_dict(model: Bert, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """cfx params for ``model`` from a ``BertForMaskedLM`` / ``BertForSequenceClassification`` state dict."""
    c = model.config
    C, V, F = c.hidden_size, c.vocab_size, c.intermediate_size
    r = StateDictReader(state_dict, where="cfx.models.from_hf (BERT)", prefix="")

    def linear(name: str, n_in: int, n_out: int) -> dict:
        return {"w": r.take(name + ".weight", (n_out, n_in), transpose=True), "b": r.take(name + ".bias", (n_out,))}

    def norm(name: str) -> dict:
        return {"scale": r.take(name + ".weight", (C,)), "bias": r.take(name + ".bias", (C,))}

    emb = "bert.embeddings."
    params = {"wte": {"w": r.take(emb + "word_embeddings.weight", (V, C))},
              "wpe": {"w": r.take(emb + "position_embeddings.weight", (c.max_position_embeddings, C))},
              "wtt": {"w": r.take(emb + "token_type_embeddings.weight", (c.type_vocab_size, C))},
              "ln_e": norm(emb + "LayerNorm"), "blocks": []}
    for i in range(c.n_layer):
        pre = f"bert.encoder.layer.{i}."
        block = {"attn": {n: linear(pre + hf, C, C) for n, hf in _ATTN},
                 "mlp": {"fc": linear(pre + "intermediate.dense", C, F), "proj": linear(pre + "output.dense", F, C)}}
        block.update({n: norm(pre + hf) for n, hf in _NORMS})
        params["blocks"].append({k: block[k] for k in ("norm1", "attn", "norm2", "mlp")})
    if c.head == "mlm":
        params["mlm"] = {"dense": linear("cls.predictions.transform.dense", C, C),
                         "ln": norm("cls.predictions.transform.LayerNorm"), "b": r.take("cls.predictions.bias", (V,))}
        tied = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
    else:
        params["pooler"] = linear("bert.pooler.dense", C, C)
        params["classifier"] = linear("classifier", C, c.num_labels)
        tied = ()
    # the tied decoder, the position-id buffer older checkpoints carry, and the pooler an MLM
    # checkpoint saved from a pre-training model may still hold
    r.finish(ignore=lambda k: k in tied or k.endswith("position_ids")
             or (c.head == "mlm" and k.startswith("bert.pooler.")))
    return params


FAMILY = Family(
    name="bert", model=Bert, hf_model_types=("bert",), config_from_hf=config_from_hf, hf_config=Bert.hf_config,
    to_hf=to_hf, from_hf=from_hf_state_dict, hf_classes=("BertForMaskedLM", "BertForSequenceClassification"),
    heads=("mlm", "classify"))
