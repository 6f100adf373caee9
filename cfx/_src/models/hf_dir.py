"""Hugging Face model directories: ``save_pretrained`` writes one that ``transformers``'
``from_pretrained`` loads, ``from_pretrained`` reads one (a single file or sharded) into cfx
params -- on a mesh, as ShardedArrays, when given one.

A directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` mapping each key to its
file (HF's layout). Reading goes through a lazy mapping over the files: a tensor is read when the
converter takes it, so a load holds the converted params and one HF tensor at a time.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

import torch

from cfx._src.core import tree as tree_util
from cfx._src.spmd.arrays import device_get
from cfx._src.checkpoint.io import write_atomic
from cfx._src.mesh.spec import P
from cfx._src.models import families, hf

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def save_pretrained(directory: str | os.PathLike, model: Any, params: Any, *,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``model`` (its HF config) and ``params`` (tensors or ShardedArrays: written whole,
    as HF files hold them; a padded vocabulary without its padding) to ``directory``; more than ``max_shard_bytes`` of weights are split
    into shards with an index, as ``transformers`` does."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    family = families.of_model(model, "cfx.models.save_pretrained")
    config = hf.hf_config(model)
    config.architectures = [family.hf_class(model)]
    config.torch_dtype = str(tree_util.leaves(params)[0].dtype).removeprefix("torch.")
    state = {k: v.contiguous() for k, v in hf.to_hf(model, device_get(params)).items()}
    shards = _pack(state, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_atomic(os.path.join(directory, name), lambda tmp, s=shard: save_file(s, tmp, metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        write_atomic(os.path.join(directory, INDEX), lambda tmp: _dump(tmp, index))
    config.save_pretrained(directory)  # config.json last: a directory without it is not a model yet


def from_pretrained(directory: str | os.PathLike, *, mesh=None, specs: Any = P()) -> tuple[Any, Any]:
    """``(model, params)`` from a Hugging Face directory (``config.json`` and safetensors weights,
    one file or sharded); with ``mesh``, params are ShardedArrays laid out by ``specs`` (a P or a
    pytree prefix, e.g. ``cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)``)."""
    model = model_of_directory(directory)
    _, params = hf.from_hf(LazyStateDict(os.fspath(directory)), model)
    if mesh is None:
        return model, params
    from cfx._src.spmd.shard_map import shard_map
    return model, shard_map(lambda t: t, mesh=mesh, in_specs=(specs,), out_specs=specs)(params)


def model_of_directory(directory: str | os.PathLike) -> Any:
    """The cfx model of a Hugging Face directory's ``config.json`` (no weights read)."""
    import transformers

    directory = os.fspath(directory)
    if not os.path.exists(os.path.join(directory, "config.json")):
        raise ValueError(f"cfx.models.from_pretrained: {directory!r} has no config.json; point at a Hugging Face "
                         "model directory (save_pretrained's output).")
    config = transformers.AutoConfig.from_pretrained(directory)
    family = families.of_model_type(getattr(config, "model_type", None), "cfx.models.from_pretrained")
    return family.build(config, family.head_of(config.architectures or []))


class LazyStateDict(Mapping):
    """The state dict of an HF directory, each tensor read from its file when asked for."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index_path, single = os.path.join(directory, INDEX), os.path.join(directory, WEIGHTS)
        if os.path.exists(index_path):
            with open(index_path) as f:
                self.where = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), WEIGHTS)
        else:
            raise ValueError(f"cfx.models.from_pretrained: {directory!r} has neither {WEIGHTS} nor {INDEX}; cfx reads "
                             "safetensors weights (re-save a .bin checkpoint with save_pretrained(safe_serialization=True)).")
        self.directory, self._open = directory, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        name = self.where[key]
        if name not in self._open:
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise ValueError(f"cfx.models.from_pretrained: {path!r} (holding {key!r}) is missing.")
            self._open[name] = safe_open(path, framework="pt")
        return self._open[name].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _pack(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, a new shard whenever the next would pass ``limit`` bytes."""
    shards, size = [{}], 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    return shards


def _dump(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
