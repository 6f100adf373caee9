"""Donated buffers: storages a caller has given up, so the code it calls may overwrite them.

JAX's donation, eager: ``shard_map(..., donate_argnums=...)`` runs each rank's body inside
``donated(<that rank's donated blocks>)``, and the functions that produce new state check
``is_donated`` before allocating -- ``cfx.optim``'s Adam sweep writes the new moments into the
old ones and the update into the gradient's buffer, ``apply_updates`` adds into the params. The
results are the same numbers as without donation; only where they live changes. Library code
may donate its own temporaries the same way (a gradient it made and will not read again).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterable

import torch

_donated: contextvars.ContextVar[frozenset] = contextvars.ContextVar("cfx_donated", default=frozenset())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself (a fake tensor's has no address)


@contextlib.contextmanager
def donated(tensors: Iterable[Any]):
    """Inside, the storages of ``tensors`` (non-tensors ignored) may be overwritten."""
    keys = {_key(t) for t in tensors if isinstance(t, torch.Tensor) and t.numel()}
    token = _donated.set(_donated.get() | keys)
    try:
        yield
    finally:
        _donated.reset(token)


def is_donated(t: Any) -> bool:
    """True when ``t``'s storage was donated here (writing into it is allowed)."""
    keys = _donated.get()
    return bool(keys) and isinstance(t, torch.Tensor) and t.numel() > 0 and _key(t) in keys


def all_donated(ts: Iterable[Any]) -> bool:
    keys = _donated.get()
    return bool(keys) and all(isinstance(t, torch.Tensor) and t.numel() > 0 and _key(t) in keys for t in ts)
