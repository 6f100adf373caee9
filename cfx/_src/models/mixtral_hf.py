"""Mixtral <-> Hugging Face ``MixtralForCausalLM``: configs and state dicts.

Llama's conversion (``llama_hf``) with the experts in each block's MLP place. transformers 5 keeps
a layer's experts as 3-D tensors: ``mlp.gate.weight`` (the router, ``(E, C)``),
``mlp.experts.gate_up_proj`` ``(E, 2I, C)`` (gate rows first) and ``mlp.experts.down_proj``
``(E, C, I)``; transformers 4's per-expert ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate, up,
down) are read too. cfx keeps ``(in, out)`` layouts: router ``(C, E)``, gate / up ``(E, C, I)``,
down ``(E, I, C)``.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from cfx._src.models import llama_hf
from cfx._src.models.family import Family
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.models.mixtral import CFX_ONLY_FIELDS, Mixtral, MixtralConfig, mixtral


def config_from_hf(hf: Any) -> MixtralConfig:
    """A ``MixtralConfig`` from a ``transformers.MixtralConfig``."""
    if getattr(hf, "sliding_window", None):
        raise ValueError(f"cfx.models.from_hf: sliding_window={hf.sliding_window} attention is not implemented "
                         "by cfx.models.Mixtral; its logits would differ past the window.")
    base = llama_hf.config_from_hf(hf)
    ours = {k: getattr(hf, f"cfx_{k}") for k in CFX_ONLY_FIELDS if getattr(hf, f"cfx_{k}", None) is not None}
    return MixtralConfig(**{**base.__dict__, "n_experts": hf.num_local_experts, "top_k": hf.num_experts_per_tok,
                            "router_aux_loss_coef": float(hf.router_aux_loss_coef), **ours})


def _experts_to_hf(sd: dict, pre: str, p: dict) -> None:
    sd[pre + "mlp.gate.weight"] = copy(p["router"].T)  # (E, C)
    sd[pre + "mlp.experts.gate_up_proj"] = copy(torch.cat([p["gate"], p["up"]], 2).transpose(1, 2))  # (E, 2I, C)
    sd[pre + "mlp.experts.down_proj"] = copy(p["down"].transpose(1, 2))  # (E, C, I)


def _experts_from_hf(r: StateDictReader, pre: str, c: MixtralConfig) -> dict:
    C, I, E = c.hidden_size, c.intermediate_size, c.n_experts
    if r.prefix + pre + "block_sparse_moe.gate.weight" in r.sd:  # transformers 4.x
        moe = pre + "block_sparse_moe."
        experts = [{n: r.take(moe + f"experts.{e}.{w}.weight", shape, transpose=True)
                    for n, w, shape in (("gate", "w1", (I, C)), ("up", "w3", (I, C)), ("down", "w2", (C, I)))}
                   for e in range(E)]
        return {"router": r.take(moe + "gate.weight", (E, C), transpose=True),
                **{n: torch.stack([x[n] for x in experts]) for n in ("gate", "up", "down")}}
    gate_up = r.take(pre + "mlp.experts.gate_up_proj", (E, 2 * I, C)).transpose(1, 2)  # (E, C, 2I)
    return {"router": r.take(pre + "mlp.gate.weight", (E, C), transpose=True),
            "gate": gate_up[..., :I].contiguous(), "up": gate_up[..., I:].contiguous(),
            "down": r.take(pre + "mlp.experts.down_proj", (E, C, I)).transpose(1, 2).contiguous()}


def to_hf(model: Mixtral, params: dict) -> dict[str, torch.Tensor]:
    """A ``MixtralForCausalLM`` state dict in transformers 5's layout."""
    return llama_hf.to_hf(model, params, mlp=_experts_to_hf)


def from_hf_state_dict(model: Mixtral, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """cfx params for ``model`` from a ``MixtralForCausalLM`` (or ``MixtralModel``) state dict."""
    return llama_hf.from_hf_state_dict(model, state_dict, mlp=_experts_from_hf)


FAMILY = Family(
    name="mixtral", model=Mixtral, hf_model_types=("mixtral",), config_from_hf=config_from_hf,
    hf_config=Mixtral.hf_config, to_hf=to_hf, from_hf=from_hf_state_dict,
    hf_classes=("MixtralForCausalLM", "MixtralModel"), preset=mixtral, peft=llama_hf.PEFT)
