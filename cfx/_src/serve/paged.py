"""The paged KV cache: one pool of blocks per layer, and the cache a model writes and reads in a step.

``KVPool(num_blocks, block_size, n_layers)`` holds, per layer, keys and values ``(num_blocks,
block_size, Hkv, D)``, allocated at the layer's first write in its dtype, device and head count (a
tensor-parallel rank's heads), like ``cfx.nn.KVCache``. A sequence's tokens live in the blocks of its
table: token ``p`` in block ``table[p // block_size]``, slot ``p % block_size``.

``PagedStep(pool, tables, starts, lengths)`` is what a model's ``apply(..., cache=)`` gets for one
engine step over ``B`` rows: row ``b`` has ``starts[b]`` tokens cached already and feeds
``lengths[b]`` new ones (right-padded to the call's ``T``). It speaks the model's cache protocol
(``k``, ``layer(i).update``, ``advance``, ``validated``): each layer writes its new keys and values
into their slots (padding writes nothing) and attends over the row's blocks, gathered through the
table (``cfx_kernels.paged_attention``'s ``gather_blocks`` and ``paged_mask``: the plain-PyTorch paged attention, the path a CPU runs), new token ``t`` seeing
the keys at positions ``<= starts[b] + t``. Its layers also ``attend`` themselves (what
``cfx.nn.Attention`` asks of a cache that can): with ``impl="triton"`` (``"auto"`` on CUDA) the
Triton kernel ``cfx_kernels.paged_attention`` reads the blocks in place, nothing gathered.
"""
from __future__ import annotations

import torch

from cfx._src.nn.attention import attention
from cfx_kernels._common import resolve_impl
from cfx_kernels.paged_attention import gather_blocks as gather, paged_attention, paged_mask, triton_unsupported


class KVPool:
    """Every layer's key and value blocks (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, n_layers: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def ensure(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``i``'s blocks, allocated like ``k``, ``v`` ``(B, T, Hkv, D)`` at its first write."""
        if self.k[i] is None:
            self.k[i] = k.new_zeros((self.num_blocks, self.block_size, *k.shape[2:]))
            self.v[i] = v.new_zeros((self.num_blocks, self.block_size, *v.shape[2:]))

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` := block ``src`` in every layer (copy-on-write of a shared block)."""
        for t in (*self.k, *self.v):
            if t is not None:
                t[dst].copy_(t[src])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class PagedStep:
    """One step's view of the pool for ``B`` rows (module doc): ``tables (B, nb)`` long (padded with
    any block), ``starts``, ``lengths`` ``(B,)`` long, on the device the model runs on."""

    validated = True  # the engine checks every request's tokens when it is added

    def __init__(self, pool: KVPool, tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, T: int,
                 impl: str = "auto"):
        self.pool, self.tables, self.starts, self.lengths, self.impl = pool, tables, starts, lengths, impl
        bs = pool.block_size
        t = torch.arange(T, device=tables.device)
        pos = starts[:, None] + t[None, :]                                       # (B, T) absolute positions
        self.real = t[None, :] < lengths[:, None]                                # (B, T) tokens, not padding
        block = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1))
        self.slots = (block * bs + pos % bs)[self.real]                          # (N,) flat slots of the real ones
        self.allowed = paged_mask(tables, starts, lengths, T, bs)                # (B, T, S) what each token sees

    @property
    def k(self) -> list:
        return self.pool.k

    def layer(self, i: int) -> "PagedLayer":
        return PagedLayer(self, i)

    def advance(self, n: int) -> None:
        del n  # the engine counts each sequence's tokens itself


class PagedLayer:
    """Layer ``i``'s view of a ``PagedStep``: what its attention writes and reads."""

    __slots__ = ("step", "i")

    def __init__(self, step: PagedStep, i: int):
        self.step, self.i = step, i

    def update(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the real new ``k``, ``v`` ``(B, T, Hkv, D)`` into their slots; return every row's keys
        and values ``(B, S, Hkv, D)`` through its table and which each new token sees ``(B, T, S)``."""
        del mask  # the step knows which tokens are real (its lengths)
        kb, vb = self._write(k, v)
        return gather(kb, self.step.tables), gather(vb, self.step.tables), self.step.allowed

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new ``k``, ``v``, then ``q`` ``(B, T, H, D)``'s attention over each row's keys: the
        Triton kernel reading the blocks in place, or (a CPU; ``impl="reference"``) the gathered blocks
        under ``cfx.nn.attention``."""
        s = self.step
        kb, vb = self._write(k, v)
        if resolve_impl(s.impl, q) == "triton" and triton_unsupported(q, kb) is None:
            return paged_attention(q, kb, vb, s.tables, s.starts, s.lengths, impl="triton")
        return attention(q, gather(kb, s.tables), gather(vb, s.tables), causal=False, mask=s.allowed)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, pool = self.step, self.step.pool
        pool.ensure(self.i, k, v)
        kb, vb = pool.k[self.i], pool.v[self.i]
        kb.view(-1, *kb.shape[2:]).index_copy_(0, s.slots, k[s.real].to(kb.dtype))
        vb.view(-1, *vb.shape[2:]).index_copy_(0, s.slots, v[s.real].to(vb.dtype))
        return kb, vb
