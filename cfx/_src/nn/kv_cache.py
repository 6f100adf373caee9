"""``KVCache``: every attention layer's keys and values so far, preallocated for a whole generation.

Decoding one token at a time, attention needs the keys and values of every earlier position; a
cache keeps them so each step computes only the new token's. ``KVCache(batch, max_len,
n_layers)`` holds, per layer, buffers ``(B, max_len, Hkv, D)`` (allocated at the layer's first
write, in the layer's own dtype, device and head count -- under tensor parallelism a rank's
heads), the key-padding mask ``(B, max_len)`` and ``length``, the positions written so far.

A model's ``apply(params, tokens, mask=, positions=, cache=)`` appends its ``T`` tokens' keys and
values at ``length`` in every layer (``layer(i).update``), attends over ``[0, length + T)`` --
causally, so the new token ``i`` sees positions ``<= length + i`` -- and then ``advance``s the
cache by ``T``. The buffers are written in place: a cache is an explicit, mutable argument, like
a donated buffer, never hidden state.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, batch: int, max_len: int, n_layers: int, *, device=None):
        if batch < 1 or max_len < 1 or n_layers < 1:
            raise ValueError(f"KVCache: batch, max_len and n_layers must be positive, got {batch}, {max_len}, "
                             f"{n_layers}.")
        self.batch, self.max_len = batch, max_len
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # True = a real key
        self.length = 0

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    def advance(self, n: int) -> None:
        """Count ``n`` more positions as written (a model's ``apply`` does it after its blocks)."""
        self.length += n

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers allocated so far."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class LayerCache:
    """Layer ``i``'s view of a ``KVCache``: what its attention writes and reads."""

    __slots__ = ("cache", "i")

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    def update(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new ``k``, ``v`` ``(B, T, Hkv, D)`` and their key mask ``(B, T)`` (None: all real)
        at ``length``; return every key, value and mask so far, ``(B, length + T, ...)``."""
        c, i = self.cache, self.i
        B, T = k.shape[:2]
        start, end = c.length, c.length + T
        if B != c.batch or end > c.max_len:
            raise ValueError(f"KVCache: {T} new positions for a batch of {B} after {start} do not fit the cache "
                             f"of batch {c.batch} and max_len {c.max_len}; make it with max_len >= prompt + new tokens.")
        if c.k[i] is None:
            c.k[i] = k.new_zeros((B, c.max_len, *k.shape[2:]))
            c.v[i] = v.new_zeros((B, c.max_len, *v.shape[2:]))
            c.mask = c.mask.to(k.device)
        c.k[i][:, start:end] = k
        c.v[i][:, start:end] = v
        if i == 0:  # the mask is shared by the layers: written once per call
            c.mask[:, start:end] = True if mask is None else mask.to(torch.bool)
        return c.k[i][:, :end], c.v[i][:, :end], c.mask[:, :end]
