"""Saved-tensor hooks that free a gathered buffer after forward and re-gather it in backward.

While a gathered layer runs, every tensor autograd saves that lies in the layer's gathered buffer
(a weight kept for the input gradient, its transpose, ...) is replaced by a ``_Ref`` -- its offset
from the buffer's start, size and stride -- so nothing holds the buffer once ``apply`` returns; the
first ``_Ref`` unpacked in backward re-gathers it (``ShardSource.get_regathered``) and every other one
is served from that buffer, which is dropped again once backward has unpacked all of them. Tensors
the hooks do not own go to the enclosing hooks (remat's, which re-gather while recomputing).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class _Ref:
    src: Any  # the gathered layer's ShardSource
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class RegatherHooks:
    """Saved-tensor hooks: tensors in ``full`` become ``_Ref``s; others go to the outer hooks."""

    def __init__(self, src: Any, full: torch.Tensor):
        self.src, self.ptr, self.device = src, full.untyped_storage()._cdata, full.device
        # ``full`` (or its first leaf: where the buffer starts) may be a view -- one rank's is of its
        # chunk's copy, which holds other groups too: only what lies in this group's range is its
        self.lo = full.storage_offset()
        self.hi = self.lo + src.layout.n * src.layout.size
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.ctx = None

    def pack(self, t: torch.Tensor):
        if t.device == self.device and t.untyped_storage()._cdata == self.ptr and self.lo <= t.storage_offset() < self.hi:
            self.src.saved += 1
            return _Ref(self.src, t.storage_offset() - self.lo, tuple(t.size()), tuple(t.stride()))
        return self.outer[0](t) if self.outer is not None else t

    def unpack(self, h):
        if isinstance(h, _Ref):
            src = h.src
            full = src.get_regathered()  # where it starts in its storage: not necessarily where forward's did
            view = full.as_strided(h.size, h.stride, full.storage_offset() + h.offset)
            src.saved -= 1
            if src.saved <= 0:  # backward has read every saved view: the buffer lives only in them now
                src.regathered = None  # (a tied embedding's, read by the head first, is not held to the end)
            return view
        return self.outer[1](h) if self.outer is not None else h

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        ctx, self.ctx = self.ctx, None  # no cycle through the bound methods: pieces die on time
        return ctx.__exit__(*exc)
