"""Dropout with an explicit key: ``dropout(x, rate, key)`` and the ``Dropout`` layer."""
from __future__ import annotations

import dataclasses

import torch

from cfx._src.core import random


def dropout(x: torch.Tensor, rate: float, key: torch.Tensor | None) -> torch.Tensor:
    """Zero each element with probability ``rate`` and scale survivors by ``1 / (1 - rate)``.

    ``key=None`` or ``rate == 0`` is the identity (evaluation). The mask depends only on the key
    and ``x.shape``, so the same key drops the same elements on every device.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate!r}.")
    if key is None or rate == 0.0:
        return x
    keep = random.bernoulli(key, 1.0 - rate, tuple(x.shape), device=x.device)
    return torch.where(keep, x / (1.0 - rate), torch.zeros((), dtype=x.dtype, device=x.device))


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A parameter-free layer: ``init`` returns ``{}``; ``apply(params, x, key=...)``."""

    rate: float

    def __post_init__(self):
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"Dropout: rate must be in [0, 1), got {self.rate!r}.")

    def init(self, key: torch.Tensor) -> dict:
        del key
        return {}

    def apply(self, params: dict, x: torch.Tensor, *, key: torch.Tensor | None = None) -> torch.Tensor:
        del params
        return dropout(x, self.rate, key)

    def axes(self) -> dict:
        return {}
