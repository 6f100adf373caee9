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

Two forms. The default is dynamic: attention reads the ``length + T`` positions written so far,
and while no padded key was written it needs no mask at all (the causal rule alone). A
``static=True`` cache is for compiled decoding (``cfx.generate(..., compile=True)``): every call
reads the whole ``max_len`` buffers with a mask that hides the slots not written yet, and the next
slot is a device tensor (``index``), so a step has the same shapes and no Python state that
changes from one token to the next -- one graph serves every step.

``validated`` says the caller has checked what the calls with this cache feed the model:
``cfx.generate`` sets it after its checked prefill (the decode steps feed tokens it picked), and
the models then skip their per-call input checks, which would read token ids back to the host.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, batch: int, max_len: int, n_layers: int, *, device=None, static: bool = False):
        if batch < 1 or max_len < 1 or n_layers < 1:
            raise ValueError(f"KVCache: batch, max_len and n_layers must be positive, got {batch}, {max_len}, "
                             f"{n_layers}.")
        self.batch, self.max_len, self.static = batch, max_len, static
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # True = a real key
        self.index = torch.zeros((), dtype=torch.long, device=device)  # static: the next slot to write
        self.validated = False  # the caller checked the inputs (module doc)
        self.padded = False     # dynamic: a padded key was written, so attention needs the mask
        self.allowed: torch.Tensor | None = None  # this call's (B, T, S) mask, made by layer 0
        self._length = 0

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    @property
    def length(self) -> int:
        """The positions written so far (a static cache reads its device counter: a host sync)."""
        return int(self.index) if self.static else self._length

    def advance(self, n: int) -> None:
        """Count ``n`` more positions as written (a model's ``apply`` does it after its blocks)."""
        if self.static:
            self.index.add_(n)
        else:
            self._length += n

    def mark_static(self) -> None:
        """Tell ``torch.compile`` the buffers keep their addresses (CUDA graphs replay over them)."""
        import torch._dynamo

        for t in (*self.k, *self.v, self.mask, self.index):
            if t is not None:
                torch._dynamo.mark_static_address(t)

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
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new ``k``, ``v`` ``(B, T, Hkv, D)`` and their key mask ``(B, T)`` (None: all real);
        return the keys and values to attend over, ``(B, S, Hkv, D)``, and which of them each new
        token may see, ``(B, T, S)`` bool with the causal rule in it -- or None where the causal rule
        alone is the answer (a dynamic cache without padded keys)."""
        c, i = self.cache, self.i
        B, T = k.shape[:2]
        if c.k[i] is None:
            c.k[i] = k.new_zeros((B, c.max_len, *k.shape[2:]))
            c.v[i] = v.new_zeros((B, c.max_len, *v.shape[2:]))
        if c.static:
            return self._static(k, v, mask)
        start, end = c._length, c._length + T
        if B != c.batch or end > c.max_len:
            raise ValueError(f"KVCache: {T} new positions for a batch of {B} after {start} do not fit the cache "
                             f"of batch {c.batch} and max_len {c.max_len}; make it with max_len >= prompt + new tokens.")
        c.k[i][:, start:end] = k
        c.v[i][:, start:end] = v
        if i == 0:  # the mask is shared by the layers: written once per call
            c.mask = c.mask.to(k.device)
            c.mask[:, start:end] = True if mask is None else mask.to(torch.bool)
            c.padded = c.padded or mask is not None
            c.allowed = _causal(c.mask[:, :end], start + torch.arange(T, device=k.device)) if c.padded else None
        return c.k[i][:, :end], c.v[i][:, :end], c.allowed

    def _static(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        # every call reads all max_len slots; the unwritten ones are hidden by the mask
        c, i = self.cache, self.i
        B, T = k.shape[:2]
        if not torch.compiler.is_dynamo_compiling() and (B != c.batch or c.length + T > c.max_len):
            raise ValueError(f"KVCache: {T} new positions for a batch of {B} after {c.length} do not fit the static "
                             f"cache of batch {c.batch} and max_len {c.max_len}.")
        slots = c.index + torch.arange(T, device=k.device)  # (T,)
        c.k[i].index_copy_(1, slots, k)
        c.v[i].index_copy_(1, slots, v)
        if i == 0:
            new = torch.ones(B, T, dtype=torch.bool, device=k.device) if mask is None else mask.to(torch.bool)
            c.mask.index_copy_(1, slots, new)
            c.allowed = _causal(c.mask, slots)
        return c.k[i], c.v[i], c.allowed


def _causal(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``(B, T, S)``: key ``j`` is real (``keys (B, S)``) and not after the query's slot (``slots (T,)``)."""
    seen = torch.arange(keys.shape[1], device=keys.device)[None, :] <= slots[:, None]  # (T, S)
    return keys[:, None, :] & seen
