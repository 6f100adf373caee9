"""ViT <-> Hugging Face ``ViTForImageClassification``: configs and state dicts.

HF ``nn.Linear`` weights are ``(out, in)``; cfx ``Linear`` weights are ``(in, out)``, so every
projection is transposed. The patch convolution has PyTorch's layout on both sides; the [CLS] token
``(1, 1, C)`` and the position table ``(1, 1 + N, C)`` lose their leading ones in cfx. A block's
``norm1`` / ``norm2`` are HF's ``layernorm_before`` / ``layernorm_after``. transformers 5's layout
(``vit.layers.{i}.attention.q_proj``, ``mlp.fc1``) is written; transformers 4's
(``vit.encoder.layer.{i}.attention.attention.query``, ``intermediate.dense``), which the checkpoints
on the Hub still carry, is read too.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models.common import check_params
from cfx._src.models.family import Family
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.models.vit import ViT, ViTConfig

# cfx name, transformers 5's, transformers 4's (under the layer's prefix)
_LINEARS = (("attn", "q", "attention.q_proj", "attention.attention.query"),
            ("attn", "k", "attention.k_proj", "attention.attention.key"),
            ("attn", "v", "attention.v_proj", "attention.attention.value"),
            ("attn", "o", "attention.o_proj", "attention.output.dense"),
            ("mlp", "fc", "mlp.fc1", "intermediate.dense"),
            ("mlp", "proj", "mlp.fc2", "output.dense"))
_NORMS = (("norm1", "layernorm_before"), ("norm2", "layernorm_after"))


def _square(hf: Any, name: str) -> int:
    v = getattr(hf, name)
    if isinstance(v, (tuple, list)):
        if len(v) != 2 or v[0] != v[1]:
            raise ValueError(f"cfx.models.from_hf: this ViT config has {name}={tuple(v)}; cfx.models.ViT takes "
                             "square images and patches.")
        v = v[0]
    return int(v)


def config_from_hf(hf: Any) -> ViTConfig:
    """A ``ViTConfig`` from a ``transformers.ViTConfig``; ValueError for what cfx cannot express."""
    problems = []
    if hf.hidden_act != "gelu":
        problems.append(f"hidden_act={hf.hidden_act!r} (cfx ViT uses exact gelu)")
    if not getattr(hf, "qkv_bias", True):
        problems.append("qkv_bias=False")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * hf.num_attention_heads != hf.hidden_size:
        problems.append(f"head_dim={head_dim} with {hf.num_attention_heads} heads of hidden_size={hf.hidden_size}")
    if problems:
        raise ValueError("cfx.models.from_hf: this ViT config has " + "; ".join(problems)
                         + ", which cfx.models.ViT does not implement.")
    return ViTConfig(image_size=_square(hf, "image_size"), patch_size=_square(hf, "patch_size"),
                     num_channels=hf.num_channels, hidden_size=hf.hidden_size, n_layer=hf.num_hidden_layers,
                     n_head=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
                     num_labels=int(hf.num_labels), dropout=float(hf.hidden_dropout_prob),
                     layer_norm_eps=float(hf.layer_norm_eps), init_std=float(hf.initializer_range))


def _linear(p: dict) -> dict:
    return {"weight": copy(p["w"].T), "bias": copy(p["b"])}


def _norm(p: dict) -> dict:
    return {"weight": copy(p["scale"]), "bias": copy(p["bias"])}


def to_hf(model: ViT, params: dict) -> dict[str, torch.Tensor]:
    """A ``ViTForImageClassification`` state dict in transformers 5's layout."""
    check_params("cfx.models.to_hf", ViT(model.config), params)
    C = model.config.hidden_size
    emb = "vit.embeddings."
    items: dict[str, dict] = {
        emb[:-1]: {"cls_token": copy(params["cls"].reshape(1, 1, C)),
                   "position_embeddings": copy(params["wpe"]["w"][None])},
        emb + "patch_embeddings.projection": {"weight": copy(params["patch"]["w"]),
                                              "bias": copy(params["patch"]["b"])},
    }
    for i, p in enumerate(params["blocks"]):
        pre = f"vit.layers.{i}."
        for group, name, hf_name, _ in _LINEARS:
            items[pre + hf_name] = _linear(p[group][name])
        for name, hf_name in _NORMS:
            items[pre + hf_name] = _norm(p[name])
    items["vit.layernorm"] = _norm(params["ln_f"])
    items["classifier"] = _linear(params["classifier"])
    return {f"{k}.{n}": t for k, d in items.items() for n, t in d.items()}


def from_hf_state_dict(model: ViT, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """cfx params for ``model`` from a ``ViTForImageClassification`` state dict (either layout)."""
    c = model.config
    C, F, L, p = c.hidden_size, c.intermediate_size, c.num_labels, c.patch_size
    r = StateDictReader(state_dict, where="cfx.models.from_hf (ViT)", prefix="")
    old = "vit.encoder.layer.0.layernorm_before.weight" in state_dict  # transformers 4's layout
    sizes = {"q": (C, C), "k": (C, C), "v": (C, C), "o": (C, C), "fc": (C, F), "proj": (F, C)}

    def linear(name: str, n_in: int, n_out: int) -> dict:
        return {"w": r.take(name + ".weight", (n_out, n_in), transpose=True), "b": r.take(name + ".bias", (n_out,))}

    def norm(name: str) -> dict:
        return {"scale": r.take(name + ".weight", (C,)), "bias": r.take(name + ".bias", (C,))}

    emb = "vit.embeddings."
    params = {"patch": {"w": r.take(emb + "patch_embeddings.projection.weight", (C, c.num_channels, p, p)),
                        "b": r.take(emb + "patch_embeddings.projection.bias", (C,))},
              "cls": r.take(emb + "cls_token", (1, 1, C)).reshape(C),
              "wpe": {"w": r.take(emb + "position_embeddings", (1, 1 + c.n_patches, C))[0]},
              "blocks": []}
    for i in range(c.n_layer):
        pre = f"vit.encoder.layer.{i}." if old else f"vit.layers.{i}."
        block: dict = {"attn": {}, "mlp": {}}
        for group, name, new_name, old_name in _LINEARS:
            block[group][name] = linear(pre + (old_name if old else new_name), *sizes[name])
        block.update({n: norm(pre + hf) for n, hf in _NORMS})
        params["blocks"].append({k: block[k] for k in ("norm1", "attn", "norm2", "mlp")})
    params["ln_f"] = norm("vit.layernorm")
    params["classifier"] = linear("classifier", C, L)
    # the pooler a checkpoint saved from a ViTModel may still hold (the classifier reads [CLS] directly)
    r.finish(ignore=lambda k: k.startswith("vit.pooler."))
    return params


# a ViTModel has no classifier: pass its state dict with one of your own and model=
FAMILY = Family(
    name="vit", model=ViT, hf_model_types=("vit",), config_from_hf=config_from_hf, hf_config=ViT.hf_config,
    to_hf=to_hf, from_hf=from_hf_state_dict, hf_classes=("ViTForImageClassification",))
