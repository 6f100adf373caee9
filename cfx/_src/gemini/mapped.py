"""Tensors whose storage is a file: the NVMe tier of state that stays a pytree.

``mapped_copy(t, directory)`` writes ``t`` to a new file in ``directory`` and returns a tensor of
the same shape backed by a shared memory map of it (``torch.from_file(..., shared=True)``). The
file is unlinked at once: the mapping keeps it alive, the space is freed when the last tensor
using it dies, and nothing is left behind after a crash. Writes into the tensor (an optimizer
step writing into donated buffers) go to the file; reads page it in. The operating system keeps
recently used pages cached in host memory and writes dirty ones back, as it would for any
memory-mapped file -- what this tier bounds is the memory the process itself must hold.
"""
from __future__ import annotations

import itertools
import os
import threading

import torch

_names = itertools.count()


def mapped_copy(t: torch.Tensor, directory: str) -> torch.Tensor:
    """A file-backed tensor equal to ``t`` (see the module doc)."""
    path = os.path.join(directory, f"cfx-{os.getpid()}-{threading.get_ident()}-{next(_names)}.bin")
    numel = max(t.numel(), 1)  # a zero-size mapping is not allowed
    try:
        flat = torch.from_file(path, shared=True, size=numel, dtype=t.dtype)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out = flat[:t.numel()].view(t.shape)
    out.copy_(t.detach())
    return out
