"""Reading a Hugging Face state dict into cfx params: key lookup with shape checks."""
from __future__ import annotations

from typing import Callable, Mapping

import torch


def copy(t: torch.Tensor) -> torch.Tensor:
    """A detached contiguous copy, so converted params never alias the source's storage."""
    return t.detach().clone(memory_format=torch.contiguous_format)


class StateDictReader:
    """Takes keys out of ``state_dict`` (under ``prefix`` if its keys carry it) and checks shapes."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], *, where: str, prefix: str):
        self.sd = state_dict  # a Mapping: a lazy one (hf_dir) reads each tensor when taken
        self.where = where
        self.prefix = prefix if any(k.startswith(prefix) for k in self.sd) else ""
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...], *, transpose: bool = False) -> torch.Tensor:
        """A copy of ``prefix + name`` (checked to have ``shape``), transposed if asked."""
        key = self.prefix + name
        if key not in self.sd:
            near = sorted(self.sd)[:5]
            raise ValueError(f"{self.where}: the state dict has no {key!r} (its first keys: {near}). "
                             "Pass the state dict of the matching Hugging Face model, and model= built "
                             "with the same config.")
        t = self.sd[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.where}: {key!r} has shape {tuple(t.shape)}, but the model's config "
                             f"expects {tuple(shape)}. Build the cfx model from the checkpoint's config.")
        self.used.add(key)
        return copy(t.T if transpose else t)

    def finish(self, ignore: Callable[[str], bool]) -> None:
        """ValueError listing keys nobody took (e.g. a checkpoint with more layers than the config)."""
        extra = sorted(k for k in self.sd if k not in self.used and not ignore(k))
        if extra:
            raise ValueError(f"{self.where}: unexpected keys in the state dict: {extra[:8]}"
                             + (" ..." if len(extra) > 8 else "")
                             + ". Was it saved from a model with a different config (e.g. more layers)?")
