"""peft's LoRA directories: ``save_peft`` writes one that ``peft.PeftModel.from_pretrained`` loads onto
the ``transformers`` model of ``cfx.models.to_hf``; ``load_peft`` reads one (peft's own) into cfx.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per adapted HF
module, ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``...lora_B.weight`` ``(out, r)``:
cfx's ``A.T`` and ``B.T`` (HF's ``Conv1D`` and ``nn.Linear`` alike: peft's adapters are ``nn.Linear`` s).
Where HF fuses Linears into one module (GPT-2's q, k and v are ``c_attn``), they map to one cfx adapter with
a shared ``A`` (``shared_a=(("q", "k", "v"),)``) whose ``B`` s are the column blocks of peft's ``lora_B.T``.
The families whose record has peft names (``Family.peft``, read from ``families.FAMILIES``) are mapped
(``_modules``).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from cfx._src.checkpoint.io import write_atomic
from cfx._src.core import random
from cfx._src.core.text import join_words
from cfx._src.lora.adapters import adapter_at, place, units_of
from cfx._src.lora.config import LoraConfig, Unit, linear_weights, resolve
from cfx._src.models import families
from cfx._src.models.family import PeftNames
from cfx._src.transforms.shapes import eval_shape

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def _names(model: Any, where: str) -> PeftNames:
    """The peft names of ``model``'s family, or a ValueError naming the families that have them."""
    family = families.find(model)
    if family is None or family.peft is None:
        mapped = [f.model.__name__ for f in families.FAMILIES if f.peft is not None]
        raise ValueError(f"{where}: peft's layout is mapped for cfx.models {join_words(mapped)}, got "
                         f"{type(model).__name__}.")
    return family.peft


def _modules(model: Any, where: str) -> dict[str, str]:
    """``{cfx adapter path: HF module name}`` for every adapter the family's peft layout can hold."""
    names = _names(model, where)
    return {**{f"blocks.{i}.{k}": names.block.format(i=i) + v for i in range(len(model.blocks))
               for k, v in names.linears.items()}, **names.top}


def _fused_hint(model: Any, unit: Unit, where: str) -> str:
    """How to adapt ``unit``'s Linears where peft's layout fuses them into one HF module (GPT-2's c_attn)."""
    for key, module in _names(model, where).linears.items():
        parent, _, name = key.rpartition(".")
        members = name.split("+")
        in_parent = unit.parent == parent or unit.parent.endswith("." + parent)
        if len(members) > 1 and in_parent and set(unit.members) & set(members):
            return (f" {type(model).__name__}'s {join_words(members)} are one module ({module.rpartition('.')[2]}) "
                    f"in Hugging Face: give them one A with shared_a=({tuple(members)},) (on the command line: "
                    f"--lora ...,shared_a={name}).")
    return ""


def _present(model: Any, where: str) -> dict[str, str]:
    """``_modules`` of the adapters this model can have (its Linears exist)."""
    linears = linear_weights(eval_shape(model.init, random.key(0)), model.axes())
    parent = lambda path: path.rpartition(".")[0]  # noqa: E731
    return {p: m for p, m in _modules(model, where).items()
            if all(f"{parent(p)}.{n}.w".lstrip(".") in linears for n in p.rpartition(".")[2].split("+"))}


def check_peft(model: Any, config: LoraConfig, where: str) -> dict[str, str]:
    """``{cfx adapter path: HF module}`` of the adapters ``config`` puts on ``model``, or a ValueError
    naming one that peft's layout of the family has no module for (and the fix)."""
    present = _present(model, where)
    for u in resolve(model, config, where):
        if u.path not in present:
            raise ValueError(f"{where}: the adapter {u.path!r} has no module in peft's layout of "
                             f"{type(model).__name__} (it maps {sorted(present)[:4]} ...)."
                             + _fused_hint(model, u, where))
    return present


def save_peft(directory: str | os.PathLike, model: Any, adapters: Any, config: LoraConfig) -> None:
    """Write ``adapters`` (of ``model``, made with ``config``) as a peft LoRA directory (module doc)."""
    from safetensors.torch import save_file

    where = "cfx.lora.save_peft"
    units = units_of(adapters, config, model, where)
    present = check_peft(model, config, where)
    tensors = {}
    for u in units:
        unit = adapter_at(adapters, u.path)
        Bs = [unit["B"]] if len(u.members) == 1 else [unit["B"][m] for m in u.members]
        key = PREFIX + present[u.path]
        tensors[key + ".lora_A.weight"] = unit["A"].detach().T.contiguous().cpu()  # (r, in)
        tensors[key + ".lora_B.weight"] = torch.cat(Bs, dim=1).detach().T.contiguous().cpu()  # (out, r)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    write_atomic(os.path.join(directory, WEIGHTS), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    chosen = {present[u.path] for u in units}
    write_atomic(os.path.join(directory, CONFIG),
                 lambda tmp: _dump(tmp, _peft_config(model, config, chosen, set(present.values()))))


def _peft_config(model: Any, config: LoraConfig, chosen: set[str], every: set[str]) -> dict:
    """peft's ``adapter_config.json``; ``target_modules`` names a module by its last name where that
    picks only ``chosen`` modules among ``every``, by its full name otherwise."""
    last = lambda m: m.rpartition(".")[2]  # noqa: E731
    whole = {n for n in map(last, chosen) if all(m in chosen for m in every if last(m) == n)}
    targets = sorted(whole) + sorted(m for m in chosen if last(m) not in whole)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "use_rslora": config.rslora,
        "target_modules": targets,
        "fan_in_fan_out": _names(model, "cfx.lora.save_peft").fan_in_fan_out,  # HF holds (in, out) weights
        "bias": "none", "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False, "layers_to_transform": None,
        "layers_pattern": None,
    }


def _dump(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _read_config(directory: str, where: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.exists(path) or not os.path.exists(os.path.join(directory, WEIGHTS)):
        raise ValueError(f"{where}: {directory!r} is not a peft adapter directory (it needs {CONFIG} and "
                         f"{WEIGHTS}; re-save a .bin adapter with save_pretrained(safe_serialization=True)).")
    with open(path) as f:
        cfg = json.load(f)
    check_implemented(cfg, f"{where}: the adapter in {directory!r}")
    return cfg


def check_implemented(cfg: dict, what: str) -> None:
    """ValueError naming the settings of peft's LoRA config ``cfg`` that cfx.lora does not implement."""
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={cfg.get('peft_type')!r} (cfx reads LORA)")
    for name in ("use_dora", "modules_to_save", "alpha_pattern", "rank_pattern", "trainable_token_indices", "lora_bias"):
        if cfg.get(name):
            problems.append(f"{name}={cfg[name]!r}")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias={cfg['bias']!r} (trained biases)")
    if problems:
        raise ValueError(f"{what} has " + "; ".join(problems) + ", which cfx.lora does not implement.")


def load_peft(directory: str | os.PathLike, model: Any) -> tuple[LoraConfig, Any]:
    """``(config, adapters)`` for ``model`` from a peft LoRA directory (peft's ``save_pretrained`` or
    ``save_peft``); ``cfx.lora.attach(params, adapters, config)`` then runs what peft's model runs."""
    from safetensors import safe_open

    where = "cfx.lora.load_peft"
    directory = os.fspath(directory)
    cfg = _read_config(directory, where)
    by_module = {m: p for p, m in _present(model, where).items()}
    found: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(directory, WEIGHTS), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key.removeprefix(PREFIX))
            if match is None or match["module"] not in by_module:
                raise ValueError(f"{where}: {key!r} in {WEIGHTS} is no LoRA weight of a module cfx maps for "
                                 f"{type(model).__name__} (keys look like {PREFIX}{next(iter(by_module))}."
                                 "lora_A.weight); was it saved for another model?")
            found.setdefault(by_module[match["module"]], {})[match["ab"]] = f.get_tensor(key)
    config = _config_for(model, cfg, found, where)
    units = resolve(model, config, where)
    return config, place(model, units, lambda u: unit_from_peft(u, found[u.path], config.r, where))


def _config_for(model: Any, cfg: dict, found: dict, where: str) -> LoraConfig:
    """The ``LoraConfig`` whose targets pick exactly the adapters ``found``: ``blocks.*.`` patterns
    where every block has one, the exact paths otherwise."""
    if not found:
        raise ValueError(f"{where}: the adapter holds no LoRA weights.")
    members = [(p.rpartition(".")[0], n) for p in found for n in p.rpartition(".")[2].split("+")]
    exact = tuple(f"{parent}.{n}.w".lstrip(".") for parent, n in members)
    general = tuple(dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", p) for p in exact))
    kw = dict(r=int(cfg["r"]), alpha=cfg["lora_alpha"], dropout=float(cfg.get("lora_dropout", 0.0)),
              rslora=bool(cfg.get("use_rslora", False)),
              shared_a=tuple(sorted({tuple(p.rpartition(".")[2].split("+")) for p in found if "+" in p})))
    config = LoraConfig(targets=general, **kw)
    if {u.path for u in resolve(model, config, where)} != set(found):
        config = LoraConfig(targets=exact, **kw)
    assert {u.path for u in resolve(model, config, where)} == set(found), (exact, sorted(found))
    return config


def unit_from_peft(u: Unit, ab: dict[str, torch.Tensor], r: int, where: str) -> dict:
    """cfx's ``{"A", "B"}`` of one unit from peft's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)``."""
    out_total = sum(u.out_features)
    A, B = ab.get("A"), ab.get("B")
    if A is None or B is None or tuple(A.shape) != (r, u.in_features) or tuple(B.shape) != (out_total, r):
        got = {k: tuple(v.shape) for k, v in ab.items()}
        raise ValueError(f"{where}: the adapter for {u.path!r} has {got}, expected lora_A {(r, u.in_features)} and "
                         f"lora_B {(out_total, r)} (r={r} from the config; a per-module rank_pattern is not "
                         "implemented).")
    A = A.T.contiguous()  # (in, r)
    Bs = list(B.T.split(list(u.out_features), dim=1))  # (r, out) each
    Bs = [b.contiguous() for b in Bs]
    return {"A": A, "B": Bs[0] if len(u.members) == 1 else dict(zip(u.members, Bs))}
