"""diffusers' LoRA file of a Stable Diffusion pipeline, both ways: ``save_diffusers`` writes the
``pytorch_lora_weights.safetensors`` that ``StableDiffusionPipeline.load_lora_weights(directory)``
loads onto the pipeline's UNet and text encoder; ``load_diffusers`` reads one (``save_diffusers``'s,
diffusers' ``save_lora_weights``, its DreamBooth-LoRA script's) into cfx adapters.

One file holds both components' adapters, each key under its component::

    unet.<diffusers module>.lora_A.weight                       (r, in)    cfx's A.T
    unet.<diffusers module>.lora_B.weight                       (out, r)   cfx's B.T
    text_encoder.text_model.<CLIPTextModel module>.lora_A.weight / lora_B.weight

The UNet's modules are named as diffusers names them (``unet.diffusers_name``: ``...attn1.to_out.0``),
the text encoder's as transformers 4 did (``clip_text.hf_modules`` under ``text_model.``, which
diffusers strips for transformers 5's flattened ``CLIPTextModel``). The safetensors metadata
``lora_adapter_metadata`` holds each component's peft ``LoraConfig`` (``unet.r``, ``unet.lora_alpha``,
``unet.target_modules``, ...): without it diffusers takes ``alpha = r``. Reading also takes the older
names of the same tensors (``lora.down`` / ``lora.up``, ``lora_linear_layer.down`` / ``.up``) and a
file without metadata (``alpha = r``, diffusers' rule).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from cfx._src.checkpoint.io import write_atomic
from cfx._src.core import random
from cfx._src.diffusion.clip_text import hf_modules
from cfx._src.diffusion.unet import diffusers_name
from cfx._src.lora.adapters import adapter_at, place, units_of
from cfx._src.lora.config import ALL_LINEAR, LoraConfig, linear_weights, resolve_shapes
from cfx._src.lora.peft import check_implemented, unit_from_peft
from cfx._src.transforms.shapes import eval_shape

WEIGHTS = "pytorch_lora_weights.safetensors"
METADATA = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
COMPONENTS = ("unet", "text_encoder")
TEXT_PREFIX = "text_model."
_KEY = re.compile(r"^(?P<component>unet|text_encoder)\.(?P<module>.+)\."
                  r"(?:lora_(?P<ab>[AB])|lora\.(?P<du>down|up)|lora_linear_layer\.(?P<dl>down|up))\.weight$")
# what load_diffusers tries before exact paths, so a file of a preset reads back as that preset
_TARGETS = (("unet-attn",), ("attn",), ("qkv",), ("attn", "mlp"), (ALL_LINEAR,))


def _model(pipe: Any, component: str) -> Any:
    return pipe.unet if component == "unet" else pipe.text_encoder


def _shapes(model: Any) -> Any:
    return eval_shape(model.init, random.key(0))


def _modules(model: Any, component: str, shapes: Any) -> dict[str, str]:
    """``{cfx Linear path: module name in the file, after the component}`` of every Linear of ``model``."""
    if component == "text_encoder":
        return hf_modules(model.config, prefix=TEXT_PREFIX)
    return {p[:-2]: diffusers_name(tuple(p[:-2].split("."))) for p in linear_weights(shapes, model.axes())}


def save_diffusers(directory: str | os.PathLike, pipe: Any, *, unet: tuple | None = None,
                   text_encoder: tuple | None = None) -> None:
    """Write ``directory/pytorch_lora_weights.safetensors`` (module doc) for ``pipe`` (a
    ``cfx.diffusion.Pipeline``) from ``unet=(adapters, config)`` and / or ``text_encoder=(adapters,
    config)``, each made by ``cfx.lora.init`` for that model."""
    from safetensors.torch import save_file

    where = "cfx.lora.save_diffusers"
    given = {c: v for c, v in zip(COMPONENTS, (unet, text_encoder)) if v is not None}
    if not given:
        raise ValueError(f"{where}: nothing to save; pass unet=(adapters, config) and / or "
                         "text_encoder=(adapters, config).")
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    for component, pair in given.items():
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], LoraConfig)):
            raise ValueError(f"{where}: {component}= takes (adapters, config), a cfx.lora.init tree and its "
                             f"LoraConfig; got {type(pair).__name__}.")
        adapters, config = pair
        model = _model(pipe, component)
        modules = _modules(model, component, _shapes(model))
        chosen = []
        for u in units_of(adapters, config, model, where):
            if len(u.members) > 1:
                raise ValueError(f"{where}: the adapter {u.path!r} shares one A among {u.members}; diffusers' layout "
                                 "has one A per Linear. Drop shared_a from the config.")
            unit, module = adapter_at(adapters, u.path), modules[u.path]
            tensors[f"{component}.{module}.lora_A.weight"] = unit["A"].detach().T.contiguous().cpu()  # (r, in)
            tensors[f"{component}.{module}.lora_B.weight"] = unit["B"].detach().T.contiguous().cpu()  # (out, r)
            chosen.append(module.removeprefix(TEXT_PREFIX))  # matches both CLIPTextModel layouts as a suffix
        metadata.update({f"{component}.{k}": v for k, v in _peft_config(config, chosen).items()})
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    meta = {"format": "pt", METADATA: json.dumps(metadata, indent=2, sort_keys=True)}
    write_atomic(os.path.join(directory, WEIGHTS), lambda tmp: save_file(tensors, tmp, metadata=meta))


def _peft_config(config: LoraConfig, modules: list[str]) -> dict:
    """The peft ``LoraConfig`` fields diffusers builds one component's adapter from."""
    return {"peft_type": "LORA", "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
            "use_rslora": config.rslora, "target_modules": sorted(modules), "bias": "none", "use_dora": False,
            "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {}}


def load_diffusers(path: str | os.PathLike, pipe: Any) -> dict[str, tuple[LoraConfig, Any]]:
    """``{component: (config, adapters)}`` for the components (``"unet"``, ``"text_encoder"``) a
    diffusers LoRA file holds adapters of (``path``: the file, or the directory holding
    ``pytorch_lora_weights.safetensors``); ``cfx.lora.attach(pipe.unet_params, adapters, config)``
    then runs what diffusers' pipeline runs after ``load_lora_weights``."""
    from safetensors import safe_open

    where = "cfx.lora.load_diffusers"
    path = os.fspath(path)
    file = path if os.path.isfile(path) else os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise ValueError(f"{where}: no {WEIGHTS} in {path!r} (pass the directory diffusers' save_lora_weights "
                         "wrote, or the .safetensors file).")
    with safe_open(file, framework="pt") as f:
        raw = (f.metadata() or {}).get(METADATA)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    metadata = json.loads(raw) if raw else {}
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # component -> module -> "A" / "B"
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: {key!r} in {file!r} is no LoRA weight in diffusers' layout (keys look like "
                             "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight); for "
                             "a kohya / A1111 file, load it with diffusers' load_lora_weights and write it back with "
                             "save_lora_weights.")
        ab = m["ab"] or {"down": "A", "up": "B"}[m["du"] or m["dl"]]
        module = m["module"].removeprefix(TEXT_PREFIX)
        found.setdefault(m["component"], {}).setdefault(module, {})[ab] = t
    if not found:
        raise ValueError(f"{where}: {file!r} holds no LoRA weights.")
    return {c: _component(pipe, c, found[c], metadata, where) for c in COMPONENTS if c in found}


def _component(pipe: Any, component: str, by_module: dict, metadata: dict, where: str) -> tuple[LoraConfig, Any]:
    """``(config, adapters)`` of one component from its ``{module: {"A", "B"}}`` and the file's metadata."""
    model = _model(pipe, component)
    shapes = _shapes(model)
    paths = {m.removeprefix(TEXT_PREFIX): p for p, m in _modules(model, component, shapes).items()}
    unknown = sorted(set(by_module) - set(paths))
    if unknown:
        raise ValueError(f"{where}: the file's {component} adapter on {unknown[0]!r} has no Linear of that name in "
                         f"this pipeline's {type(model).__name__} (it has {sorted(paths)[:3]} ...); was it saved for "
                         "another model?")
    cfg = {k[len(component) + 1:]: v for k, v in metadata.items() if k.startswith(component + ".")}
    check_implemented(cfg, f"{where}: the {component} adapter")
    ranks = {ab["A"].shape[0] for ab in by_module.values() if "A" in ab}
    if len(ranks) > 1 and "r" not in cfg:
        raise ValueError(f"{where}: the {component} adapters have ranks {sorted(ranks)}; cfx.lora takes one r per "
                         "config (a per-module rank_pattern is not implemented).")
    r = int(cfg.get("r", min(ranks, default=1)))
    kw = dict(r=r, alpha=cfg.get("lora_alpha", r), dropout=float(cfg.get("lora_dropout", 0.0)),
              rslora=bool(cfg.get("use_rslora", False)))
    found = {paths[m]: ab for m, ab in by_module.items()}
    config = _config_for(model, shapes, set(found), kw, where)
    units = resolve_shapes(shapes, model.axes(), config, where)
    return config, place(model, units, lambda u: unit_from_peft(u, found[u.path], r, where))


def _config_for(model: Any, shapes: Any, found: set[str], kw: dict, where: str) -> LoraConfig:
    """The ``LoraConfig`` whose targets pick exactly the Linears ``found``: a preset where one does
    (``_TARGETS``), their exact paths otherwise."""
    for targets in _TARGETS:
        config = LoraConfig(targets=targets, **kw)
        try:
            picked = {u.path for u in resolve_shapes(shapes, model.axes(), config, where)}
        except ValueError:  # the preset picks nothing in this model
            continue
        if picked == found:
            return config
    return LoraConfig(targets=tuple(sorted(p + ".w" for p in found)), **kw)
