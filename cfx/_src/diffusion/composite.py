"""Layers made of layers: ``init`` / ``axes`` of a layer from the layers (and dicts / lists of
layers) in its ``_sublayers`` (``keep_sublayers``), one key each; ``map_units``: the layers of some
kinds inside (a UNet's resnets and transformers, its *blocks*) replaced."""
from __future__ import annotations

import copy

from typing import Any

import torch

from cfx._src.nn.linear import split_keys


def init_layers(layers: Any, key: torch.Tensor) -> Any:
    """Params of a layer, or of a dict / list of layers (one key each)."""
    if isinstance(layers, dict):
        return {n: init_layers(v, k) for (n, v), k in zip(layers.items(), split_keys(key, len(layers)))}
    if isinstance(layers, list):
        return [init_layers(v, k) for v, k in zip(layers, split_keys(key, len(layers)))]
    return layers.init(key)


def axes_of(layers: Any) -> Any:
    if isinstance(layers, dict):
        return {n: axes_of(v) for n, v in layers.items()}
    if isinstance(layers, list):
        return [axes_of(v) for v in layers]
    return layers.axes()


class Composite:
    """``init`` / ``axes`` of a layer made of the layers (and lists of layers) in its ``_sublayers``."""

    def init(self, key: torch.Tensor) -> dict:
        return init_layers(self._sublayers, key)

    def axes(self) -> dict:
        return axes_of(self._sublayers)


def map_units(layers: Any, kinds: tuple[type, ...], f: Any) -> Any:
    """``layers`` (a layer, or a dict / list of them) with every layer of ``kinds`` replaced by
    ``f(layer)``; the composites on the way are copied around their mapped sublayers (the
    originals, shared by every caller, stay as they are)."""
    if isinstance(layers, dict):
        return {n: map_units(v, kinds, f) for n, v in layers.items()}
    if isinstance(layers, list):
        return [map_units(v, kinds, f) for v in layers]
    if isinstance(layers, kinds):
        return f(layers)
    if isinstance(layers, Composite):
        out = copy.copy(layers)
        object.__setattr__(out, "_sublayers", map_units(layers._sublayers, kinds, f))
        return out
    return layers

