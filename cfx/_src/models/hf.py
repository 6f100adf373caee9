"""Hugging Face interop for every cfx model: ``to_hf``, ``from_hf``, ``hf_config``.

``transformers`` is imported only by the functions that build HF configs; converting state dicts
needs nothing but torch.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models import bert_hf, gpt2_hf, llama_hf, mixtral_hf, opt_hf, vit_hf
from cfx._src.models.bert import Bert
from cfx._src.models.gpt2 import GPT2
from cfx._src.models.llama import Llama
from cfx._src.models.mixtral import Mixtral
from cfx._src.models.opt import OPT
from cfx._src.models.vit import ViT


def _converter(model: Any, where: str):
    if isinstance(model, GPT2):
        return gpt2_hf
    if isinstance(model, Mixtral):  # a Llama with experts: before Llama
        return mixtral_hf
    if isinstance(model, Llama):
        return llama_hf
    if isinstance(model, Bert):
        return bert_hf
    if isinstance(model, OPT):
        return opt_hf
    if isinstance(model, ViT):
        return vit_hf
    raise ValueError(f"{where}: expected a cfx.models.GPT2, Llama, Mixtral, Bert, OPT or ViT, got "
                     f"{type(model).__name__}.")


def hf_config(model: Any) -> Any:
    """The ``transformers`` config (``GPT2Config`` / ``LlamaConfig`` / ``BertConfig`` / ``OPTConfig`` /
    ``ViTConfig``) matching ``model``."""
    _converter(model, "cfx.models.hf_config")
    return model.hf_config()


def model_from_hf_config(hf_config: Any, *, head: str = "mlm") -> GPT2 | Llama | Bert | OPT | ViT:
    """The cfx model for a ``transformers`` config (``model_type`` ``"gpt2"``, ``"llama"``,
    ``"mixtral"``, ``"bert"``, ``"opt"`` or ``"vit"``; for BERT, ``head`` ``"mlm"`` or ``"classify"``)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return GPT2(gpt2_hf.config_from_hf(hf_config))
    if kind == "llama":
        return Llama(llama_hf.config_from_hf(hf_config))
    if kind == "mixtral":
        return Mixtral(mixtral_hf.config_from_hf(hf_config))
    if kind == "bert":
        return Bert(bert_hf.config_from_hf(hf_config, head))
    if kind == "opt":
        return OPT(opt_hf.config_from_hf(hf_config))
    if kind == "vit":
        return ViT(vit_hf.config_from_hf(hf_config))
    raise ValueError(f"cfx.models.from_hf: model_type {kind!r} is not supported; cfx converts 'gpt2', "
                     "'llama', 'mixtral', 'bert', 'opt' and 'vit' checkpoints.")


def to_hf(model: GPT2 | Llama | Bert | OPT | ViT, params: Any) -> dict[str, torch.Tensor]:
    """A state dict with exactly the keys HF's ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
    ``BertForMaskedLM`` / ``BertForSequenceClassification`` / ``OPTForCausalLM`` /
    ``ViTForImageClassification`` expects.

    Load it with ``hf_model.load_state_dict(sd, strict=True)`` into a model built from
    ``model.hf_config()``. Tensors are copies in the params' dtype.
    """
    return _converter(model, "cfx.models.to_hf").to_hf(model, params)


def from_hf(hf_model_or_state_dict: Any, model: GPT2 | Llama | Bert | OPT | ViT | None = None) -> tuple[Any, dict]:
    """``(model, params)`` from an HF model, or from a bare state dict plus ``model``.

    Given an HF model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``OPTForCausalLM`` or their base
    models, ``BertForMaskedLM``, ``BertForSequenceClassification``, ``ViTForImageClassification``), the cfx
    model is built from its ``config`` unless ``model`` is passed. Params are copies in the
    checkpoint's dtype.
    """
    src = hf_model_or_state_dict
    if isinstance(src, Mapping):
        if model is None:
            raise ValueError("cfx.models.from_hf: a bare state dict carries no config; pass model= "
                             "(e.g. cfx.models.gpt2('small')), or pass the HF model itself.")
        state_dict = src
    elif hasattr(src, "state_dict") and hasattr(src, "config"):
        if model is None:
            kind = getattr(src.config, "model_type", None)
            head = bert_hf.head_of(src) if kind == "bert" else "mlm"
            if kind == "vit":
                vit_hf.check_hf_model(src)
            model = model_from_hf_config(src.config, head=head)
        state_dict = src.state_dict()
    else:
        raise ValueError(f"cfx.models.from_hf: expected a Hugging Face model or a state dict, got "
                         f"{type(src).__name__}.")
    params = _converter(model, "cfx.models.from_hf").from_hf_state_dict(model, state_dict)
    return model, params
