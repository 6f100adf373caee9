"""A language model's vocabulary padded to a multiple of a size, and the padding stripped again.

A vocabulary splits over a mesh axis in equal contiguous ranges (``cfx.parallel.tensor_parallel``), so
GPT-2's 50,257 ids cannot split over ``model=2``. ``pad_vocab`` grows every table and head whose axis
is ``"vocab"`` to the next multiple (Megatron-LM's ``make_vocab_size_divisible_by``), the new rows
zero, and masks the padded ids' logits (``cfx.nn.vocab.PaddedVocab``, the model's ``"vocab_pad"``
sublayer): the loss, greedy tokens and samples are the unpadded model's, and the padding never
trains. ``unpad_vocab`` is its inverse; Hugging Face export (``to_hf``, ``save_pretrained``) strips
the padding itself, so a saved directory holds the real vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.models.parts import hook, vocab_size
from cfx._src.nn.vocab import PaddedVocab, TokenLoss

WHERE = "cfx.models.pad_vocab"


def pad_vocab(model: Any, params: Any = None, *, multiple: int) -> Any:
    """``model`` with its vocabulary padded to a multiple of ``multiple`` -- and ``(model, params)`` when
    given ``params`` (whole tensors), the new rows of each vocabulary table zero. A vocabulary already
    a multiple is left as it is; a padded model pads anew from its real size."""
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"{WHERE}: multiple must be a positive int (e.g. the model axis size, or 64 x it), got "
                         f"{multiple!r}.")
    _check_model(model)
    size = model.real_vocab_size
    padded = -(-size // multiple) * multiple
    kept = tuple((k, v) for k, v in model.layers if k != "vocab_pad")
    if padded != size:
        kept += (("vocab_pad", PaddedVocab(size)),)
    out = dataclasses.replace(model, config=dataclasses.replace(model.config, vocab_size=padded), layers=kept)
    if params is None:
        return out
    return out, _resized(params, model, padded)


def unpad_vocab(model: Any, params: Any = None) -> Any:
    """``model`` (and ``params``) with ``pad_vocab``'s padding stripped: the real vocabulary's tables;
    a model never padded comes back as it is."""
    held = getattr(hook(model, "config"), "vocab_size", None)  # (None: no vocabulary at all, a ViT's)
    if held is None or vocab_size(model) == held:
        return model if params is None else (model, params)
    return pad_vocab(model, params, multiple=1)


def _check_model(model: Any) -> None:
    """ValueError unless ``model`` is a language model of ``cfx.models`` not yet split or wrapped."""
    replaced = sorted(k for k, _ in getattr(model, "layers", ()) if k != "vocab_pad")
    if replaced and hasattr(model, "real_vocab_size"):
        raise ValueError(f"{WHERE}: {type(model).__name__}'s {replaced} are already replaced (a parallel split?); "
                         "pad the vocabulary of the plain model, then split it or hand it to a Plan.")
    sublayers = hook(model, "sublayers")
    if not (callable(sublayers) and isinstance(sublayers().get("loss"), TokenLoss)):
        raise ValueError(f"{WHERE}: {type(model).__name__} has no vocabulary to pad (a language model of cfx.models "
                         "-- GPT-2, Llama, Mixtral, OPT, a BERT with head='mlm' -- has; pad a LoRA model's base "
                         "before attaching the adapters).")


def _resized(params: Any, model: Any, size: int) -> Any:
    """``params`` (laid out as ``model.axes()``) with every ``"vocab"`` dimension cut or zero-padded to ``size``."""
    def resize(names: tuple, x: Any) -> Any:
        if "vocab" not in names:
            return x
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{WHERE}: params must be whole tensors (a {type(x).__name__} holds a vocabulary "
                             "table); gather them first (cfx.device_get), pad, then place them.")
        d = names.index("vocab")
        now = x.shape[d]
        if now >= size:
            return x.narrow(d, 0, size).clone()
        pad = list(x.shape)
        pad[d] = size - now
        return torch.cat([x, x.new_zeros(pad)], dim=d)
    return tree_util.map(resize, model.axes(), params, is_leaf=tree_util.is_axes_leaf)
