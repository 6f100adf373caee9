"""A model family's record: everything that names it outside its own model file, in one frozen value
(torchtitan's ``TrainSpec`` habit). Each ``*_hf.py`` module exports its family's ``FAMILY``;
``families.FAMILIES`` lists them, and Hugging Face interop (``hf``, ``hf_dir``), peft's adapter
directories (``cfx._src.lora.peft``) and the training job's ``--model`` read that list and nothing else.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

from cfx._src.core.text import join_words


@dataclasses.dataclass(frozen=True)
class PeftNames:
    """A family's Linear weights as peft (and its HF model) name them, as plain data.

    ``block`` is HF's prefix of block ``i`` (``"transformer.h.{i}."``); ``linears`` maps a cfx adapter
    path under a block to the HF module under that prefix, a fused HF module's cfx members joined by
    ``+`` (GPT-2's ``"attn.q+k+v": "attn.c_attn"``: one adapter with a shared ``A``); ``top`` maps
    top-level adapters to whole HF module names (``"lm_head"``). ``fan_in_fan_out``: HF holds the
    weights ``(in, out)`` (GPT-2's ``Conv1D``), as peft's ``adapter_config.json`` must say."""

    block: str
    linears: Mapping[str, str]
    top: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fan_in_fan_out: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family: its cfx type, its Hugging Face names and conversions, its training preset.

    ``name``: how the training job names it (``--model NAME``). ``model``: the cfx model class (a
    model is of the family whose class is nearest in its MRO). ``hf_model_types``: the ``model_type`` s of
    the ``transformers`` configs it reads. ``config_from_hf(hf_config[, head])`` -> cfx config and
    ``hf_config(model)`` -> ``transformers`` config: the configs both ways. ``to_hf(model, params)`` ->
    state dict and ``from_hf(model, state_dict)`` -> params: the weights both ways. ``hf_classes``: the
    ``transformers`` model classes whose weights those are, what ``cfx.models.from_hf`` takes (the first
    is what ``save_pretrained`` names). ``heads``: for a family whose config has several heads (BERT),
    each of ``hf_classes``' ``config.head`` (then ``config_from_hf`` takes the head); empty otherwise.
    ``preset(preset, **overrides)``: the model ``python -m cfx.train --model NAME`` builds (None: the
    job does not train the family). ``peft``: its Linear names in peft's adapter directories (None: no
    peft layout)."""

    name: str
    model: type
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[..., Any]
    hf_config: Callable[[Any], Any]
    to_hf: Callable[[Any, Any], dict]
    from_hf: Callable[[Any, Mapping], Any]
    hf_classes: tuple[str, ...]
    heads: tuple[str, ...] = ()
    preset: Callable[..., Any] | None = None
    peft: PeftNames | None = None

    def __post_init__(self):
        assert not self.heads or len(self.heads) == len(self.hf_classes), (self.name, self.heads, self.hf_classes)

    def build(self, hf_config: Any, head: str | None = None) -> Any:
        """The cfx model of ``hf_config``; ``head`` is one of ``heads`` (the first by default)."""
        if not self.heads:
            return self.model(self.config_from_hf(hf_config))
        return self.model(self.config_from_hf(hf_config, head or self.heads[0]))

    def head_of(self, hf_classes: Iterable[str]) -> str | None:
        """The head of the first of ``hf_classes`` (e.g. a config's ``architectures``) that is one of
        this family's, else its first head; None for a family without heads."""
        if not self.heads:
            return None
        return next((self.heads[self.hf_classes.index(c)] for c in hf_classes if c in self.hf_classes),
                    self.heads[0])

    def hf_class(self, model: Any) -> str:
        """The ``transformers`` class ``model``'s weights are (a BERT's by its head)."""
        return self.hf_classes[self.heads.index(model.config.head) if self.heads else 0]

    def hf_class_of(self, hf_model: Any, where: str) -> str:
        """The one of ``hf_classes`` that ``hf_model`` is (its class or a base of it), or a ValueError."""
        for cls in type(hf_model).__mro__:
            if cls.__name__ in self.hf_classes:
                return cls.__name__
        raise ValueError(f"{where}: {type(hf_model).__name__} is not supported; cfx converts "
                         f"{join_words(self.hf_classes)} (or pass a state dict with the keys one of those "
                         "holds, and model=).")
