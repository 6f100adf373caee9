"""What autograd saves for backward, seen through one saved-tensor hook.

``with SavedTensors(skip=storage_keys(inputs)) as saved:`` runs the code inside with a pack hook
that records every storage autograd saves for backward once (``saved.storages``: key -> (storage,
bytes of the first tensor saved from it)), leaving out the storages in ``skip`` (a stage's inputs
and params, which live anyway), and hands each new one to ``on_save`` (e.g. ``cfx.memory.watch``).
The saved tensors pass through detached: a saved output holding its own ``grad_fn`` would be a
reference cycle outliving its graph. remat's chain executor keeps the storages of a stage's
graph, its profiler counts their bytes, and the pipeline executor books them as activations.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (equal for every view of it while it lives)."""
    return t.untyped_storage()._cdata


def storage_keys(tensors: Iterable[Any]) -> set[int]:
    return {storage_key(t) for t in tensors if isinstance(t, torch.Tensor)}


class SavedTensors:
    """The storages saved for backward while active (module doc)."""

    def __init__(self, skip: Iterable[int] = (), *, on_save: Callable[[torch.Tensor], None] | None = None):
        self.skip = set(skip)
        self.on_save = on_save
        self.storages: dict[int, tuple[Any, int]] = {}  # key -> (storage, bytes); kept alive: keys stay unique
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.skip and key not in self.storages:
            self.storages[key] = (t.untyped_storage(), t.numel() * t.element_size())
            if self.on_save is not None:
                self.on_save(t)
        return t.detach()

    def nbytes(self) -> int:
        """The bytes of the saved tensors, one tensor per storage."""
        return sum(n for _, n in self.storages.values())

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None  # no cycle through the bound hook: the storages die with the graph
        hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
