"""The model families, listed once: ``FAMILIES``, each ``*_hf.py`` module's ``Family`` record, and the
three ways to look one up -- by a cfx model (``of_model``), by a ``transformers`` config's
``model_type`` (``of_model_type``), by the training job's name (``named``) -- and a decoder of given widths
(``decoder_of_shape``).

A new family is one record in its ``*_hf.py`` and one entry here: ``cfx.models.to_hf`` / ``from_hf`` /
``hf_config`` / ``from_pretrained`` / ``save_pretrained``, ``cfx.lora.save_peft`` / ``load_peft`` and
``python -m cfx.train --model`` read this tuple when called, and name no family themselves.
"""
from __future__ import annotations

from typing import Any

from cfx._src.core.text import join_words
from cfx._src.models import bert_hf, gpt2_hf, llama_hf, mixtral_hf, opt_hf, vit_hf
from cfx._src.models.family import Family

FAMILIES: tuple[Family, ...] = (gpt2_hf.FAMILY, llama_hf.FAMILY, mixtral_hf.FAMILY, bert_hf.FAMILY, opt_hf.FAMILY,
                                vit_hf.FAMILY)


def find(model: Any) -> Family | None:
    """The family of ``model``: the one whose class is nearest in ``type(model)``'s MRO (a Mixtral is a
    Llama, and of the Mixtral family); None if it has none."""
    mro = type(model).__mro__
    found = [f for f in FAMILIES if f.model in mro]
    return min(found, key=lambda f: mro.index(f.model)) if found else None


def of_model(model: Any, where: str) -> Family:
    """``find(model)``, or a ValueError naming the families' types."""
    family = find(model)
    if family is None:
        raise ValueError(f"{where}: expected a cfx.models.{join_words([f.model.__name__ for f in FAMILIES], 'or')}, "
                         f"got {type(model).__name__}.")
    return family


def of_model_type(kind: Any, where: str) -> Family:
    """The family reading ``transformers`` configs of ``model_type`` ``kind``, or a ValueError."""
    for family in FAMILIES:
        if kind in family.hf_model_types:
            return family
    kinds = [repr(k) for f in FAMILIES for k in f.hf_model_types]
    raise ValueError(f"{where}: model_type {kind!r} is not supported; cfx converts {join_words(kinds)} checkpoints.")


def trained() -> tuple[str, ...]:
    """The names ``python -m cfx.train --model`` takes: the families with a preset."""
    return tuple(f.name for f in FAMILIES if f.preset is not None)


def named(name: str, where: str) -> Family:
    """The family the training job calls ``name``, or a ValueError listing those it trains."""
    for family in FAMILIES:
        if family.name == name and family.preset is not None:
            return family
    raise ValueError(f"{where}: unknown model {name!r}; choose {join_words(trained(), 'or')}.")


def decoder_of_shape(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, *, gated: bool,
                     positions: int) -> Any:
    """A cfx decoder of these widths (what ``cfx.parallel.estimate`` rehearses a bare shape's step with):
    Llama's blocks where the MLP is gated (SwiGLU), GPT-2's otherwise."""
    if gated:
        return llama_hf.FAMILY.preset("tiny", n_layer=layers, hidden_size=hidden, intermediate_size=ffn, n_head=heads,
                                      n_kv_heads=kv_heads, vocab_size=vocab, max_position_embeddings=positions)
    return gpt2_hf.FAMILY.preset("small", n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                 n_positions=positions)
