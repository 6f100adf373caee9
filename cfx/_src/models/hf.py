"""Hugging Face interop for every cfx model family (``families.FAMILIES``): ``to_hf``, ``from_hf``,
``hf_config``.

``transformers`` is imported only by the functions that build HF configs; converting state dicts
needs nothing but torch.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models import families
from cfx._src.models.vocab_pad import unpad_vocab


def hf_config(model: Any) -> Any:
    """The ``transformers`` config (``GPT2Config``, ``LlamaConfig``, ...) matching ``model`` (its real
    vocabulary: ``cfx.models.pad_vocab``'s padding stripped)."""
    return families.of_model(model, "cfx.models.hf_config").hf_config(unpad_vocab(model))


def model_from_hf_config(hf_config: Any, *, head: str = "mlm") -> Any:
    """The cfx model for a ``transformers`` config of a ``model_type`` a family reads (``"gpt2"``,
    ``"llama"``, ...: ``families.FAMILIES``); for BERT, ``head`` ``"mlm"`` or ``"classify"``."""
    family = families.of_model_type(getattr(hf_config, "model_type", None), "cfx.models.from_hf")
    return family.build(hf_config, head)


def to_hf(model: Any, params: Any) -> dict[str, torch.Tensor]:
    """A state dict with exactly the keys the model's HF class (its family's ``hf_class(model)``, e.g.
    ``GPT2LMHeadModel``) expects.

    Load it with ``hf_model.load_state_dict(sd, strict=True)`` into a model built from
    ``cfx.models.hf_config(model)``. Tensors are copies in the params' dtype; a padded vocabulary
    (``cfx.models.pad_vocab``) is written without its padding.
    """
    return families.of_model(model, "cfx.models.to_hf").to_hf(*unpad_vocab(model, params))


def from_hf(hf_model_or_state_dict: Any, model: Any = None) -> tuple[Any, dict]:
    """``(model, params)`` from an HF model, or from a bare state dict plus ``model``.

    Given an HF model (of one of its family's ``hf_classes``: ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
    ``OPTForCausalLM`` or their base models, ``BertForMaskedLM``, ...), the cfx model is built from its
    ``config`` unless ``model`` is passed. Params are copies in the checkpoint's dtype.
    """
    src = hf_model_or_state_dict
    if isinstance(src, Mapping):
        if model is None:
            raise ValueError("cfx.models.from_hf: a bare state dict carries no config; pass model= "
                             "(e.g. cfx.models.gpt2('small')), or pass the HF model itself.")
        state_dict = src
    elif hasattr(src, "state_dict") and hasattr(src, "config"):
        if model is None:
            family = families.of_model_type(getattr(src.config, "model_type", None), "cfx.models.from_hf")
            model = family.build(src.config, family.head_of([family.hf_class_of(src, "cfx.models.from_hf")]))
        state_dict = src.state_dict()
    else:
        raise ValueError(f"cfx.models.from_hf: expected a Hugging Face model or a state dict, got "
                         f"{type(src).__name__}.")
    params = families.of_model(model, "cfx.models.from_hf").from_hf(model, state_dict)
    return model, params
