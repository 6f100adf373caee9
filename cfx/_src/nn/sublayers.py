"""A composite layer's sublayers, built once when the layer is made.

Layers are frozen dataclasses of static configuration; a composite (a block, attention, an MLP,
a model) describes itself through the sublayers its fields imply. Building them on every
``apply`` made each step construct and validate thousands of small dataclasses, so a composite
builds them in ``__post_init__`` and keeps them beside its fields: not a field, so equality,
hashing, ``repr`` and ``dataclasses.replace`` (which builds anew) see only the configuration.
"""
from __future__ import annotations

from typing import Any


def keep_sublayers(layer: Any, sublayers: dict) -> None:
    """Keep ``sublayers`` on the frozen ``layer``; ``layer._sublayers`` reads them (shared by
    every caller: copy before changing one)."""
    object.__setattr__(layer, "_sublayers", sublayers)
