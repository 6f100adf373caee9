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
table (``KVPool.gather``, as ``cfx_kernels.paged_attention``'s ``gather_blocks``, and ``paged_mask``: the plain-PyTorch paged attention, the path a CPU runs), new token ``t`` seeing
the keys at positions ``<= starts[b] + t``. Its layers also ``attend`` themselves (what
``cfx.nn.Attention`` asks of a cache that can): with ``impl="triton"`` the Triton kernel
``cfx_kernels.paged_attention`` reads the blocks in place, nothing gathered; ``"auto"`` on CUDA runs
whichever of the two measured faster on that GPU at that shape (``paged_choice``).
"""
from __future__ import annotations

import torch

from cfx._src.nn.attention import masked_sdpa, sdpa_mask
from cfx._src.serve.paged_choice import choose
from cfx_kernels._common import resolve_impl
from cfx_kernels.paged_attention import paged_attention, paged_mask, triton_unsupported


class KVPool:
    """Every layer's key and value blocks (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, n_layers: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self._scratch: list[torch.Tensor | None] = [None, None]  # gathered keys, values (``gather``)
        self.device: torch.device | None = None  # where its rank's params are (the engine's, at its first step)

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

    def gather(self, blocks: torch.Tensor, tables: torch.Tensor, slot: int) -> torch.Tensor:
        """Each row's blocks of ``blocks`` (a layer's keys or values) in table order, ``(B, nb * bs, Hkv, D)``
        (``gather_blocks``), written into scratch memory kept across layers and steps (``slot``: 0 keys,
        1 values): each layer's attention reads its gather before the next layer's overwrites it, and
        memory fresh every time would be faulted in page by page -- half the gather's time on a CPU."""
        B, nb = tables.shape
        buf = self._scratch[slot]
        if buf is None or buf.shape[0] < B * nb or buf.shape[1:] != blocks.shape[1:] or buf.dtype != blocks.dtype \
                or buf.device != blocks.device:
            buf = self._scratch[slot] = blocks.new_empty((B * nb, *blocks.shape[1:]))
        out = torch.index_select(blocks, 0, tables.reshape(-1), out=buf[:B * nb])
        return out.view(B, nb * blocks.shape[1], *blocks.shape[2:])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class PagedStep:
    """One step's view of the pool for ``B`` rows (module doc): ``tables (B, nb)`` long (padded with
    any block), ``starts``, ``lengths`` ``(B,)`` long, on the device the model runs on."""

    validated = True  # the engine checks every request's tokens when it is added

    def __init__(self, pool: KVPool, tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, T: int,
                 impl: str = "auto", *, dense: bool = False):
        self.pool, self.tables, self.starts, self.lengths, self.impl = pool, tables, starts, lengths, impl
        bs = pool.block_size
        t = torch.arange(T, device=tables.device)
        pos = starts[:, None] + t[None, :]                                       # (B, T) absolute positions
        # (B, T) tokens, not padding; None when ``dense``: every row feeds T tokens (a decode step)
        self.real = None if dense else t[None, :] < lengths[:, None]
        block = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1))
        slots = block * bs + pos % bs
        self.slots = slots.reshape(-1) if dense else slots[self.real]            # (N,) flat slots of the real ones
        self.allowed = paged_mask(tables, starts, lengths, T, bs)                # (B, T, S) what each token sees
        self._groups: list[RowGroup] | None = None                               # made at the first attend

    def attend_reference(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        """``q`` ``(B, T, H, D)``'s attention over each row's blocks of ``kb``, ``vb`` (a layer's), gathered:
        in up to two groups of rows by how many blocks they read (``row_groups``), so a short row does
        not gather and attend over the longest row's blocks."""
        if self._groups is None:
            self._groups = row_groups(self.tables, self.starts + self.lengths, self.allowed, self.pool.block_size)
        if len(self._groups) == 1:
            g = self._groups[0]
            return g.attend(q, self.pool.gather(kb, g.tables, 0), self.pool.gather(vb, g.tables, 1))
        out = torch.empty_like(q)
        for g in self._groups:  # each group's gather reused by the next (KVPool.gather's scratch)
            out[g.rows] = g.attend(q[g.rows], self.pool.gather(kb, g.tables, 0), self.pool.gather(vb, g.tables, 1))
        return out

    @property
    def k(self) -> list:
        return self.pool.k

    def layer(self, i: int) -> "PagedLayer":
        return PagedLayer(self, i)

    def advance(self, n: int) -> None:
        del n  # the engine counts each sequence's tokens itself


class RowGroup:
    """Rows of a step attending together: their ``rows`` (None: every row, in order), block ``tables``
    ``(R, nb)`` cut to the longest of them, and the SDPA mask over those blocks, made once a step."""

    def __init__(self, rows: torch.Tensor | None, tables: torch.Tensor, allowed: torch.Tensor):
        self.rows, self.tables = rows, tables
        self.mask, blind = sdpa_mask(allowed[:, None])  # (R, 1, T, S), and the padding tokens (R, 1, T, 1)
        self.blind = blind if bool(blind.any()) else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``cfx.nn.attention``'s masked path (``masked_sdpa``) of ``q`` ``(R, T, H, D)`` over gathered ``k``,
        ``v`` ``(R, S, Hkv, D)``, its mask made once a step rather than once a layer."""
        return masked_sdpa(q, k, v, self.mask, self.blind)


def row_groups(tables: torch.Tensor, seen: torch.Tensor, allowed: torch.Tensor, block_size: int) -> list[RowGroup]:
    """One group of every row, or two -- the rows reading the fewest blocks, the rest -- where the split
    gathers and attends over at most three quarters of the blocks one group would (``seen``: each row's
    tokens after the step; a row reads its first ``ceil(seen / block_size)`` blocks)."""
    need = ((seen + block_size - 1) // block_size).clamp(min=1)
    order = torch.argsort(need, stable=True)
    sorted_need = need[order].tolist()
    B, widest = len(sorted_need), sorted_need[-1]
    cost = [k * sorted_need[k - 1] + (B - k) * widest for k in range(1, B)]
    k = min(range(1, B), key=lambda k: cost[k - 1]) if B > 1 else 0
    if not k or 4 * cost[k - 1] > 3 * B * widest:
        return [RowGroup(None, tables, allowed)]
    groups = []
    for rows, nb in ((order[:k], sorted_need[k - 1]), (order[k:], widest)):
        groups.append(RowGroup(rows, tables[rows, :nb], allowed[rows][:, :, :nb * block_size]))
    return groups


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
        s = self.step
        return s.pool.gather(kb, s.tables, 0), s.pool.gather(vb, s.tables, 1), s.allowed

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new ``k``, ``v``, then ``q`` ``(B, T, H, D)``'s attention over each row's keys: the
        Triton kernel reading the blocks in place, or (a CPU; ``impl="reference"``) the gathered blocks
        (``attend_reference``); ``"auto"`` on CUDA runs the one measured faster there (``paged_choice``)."""
        s = self.step
        kb, vb = self._write(k, v)
        if resolve_impl(s.impl, q) == "triton" and triton_unsupported(q, kb) is None and (
                s.impl != "auto" or choose(q, kb, attend_reference) == "triton"):
            return paged_attention(q, kb, vb, s.tables, s.starts, s.lengths, impl="triton")
        return s.attend_reference(q, kb, vb)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, pool = self.step, self.step.pool
        pool.ensure(self.i, k, v)
        kb, vb = pool.k[self.i], pool.v[self.i]
        k, v = (k.flatten(0, 1), v.flatten(0, 1)) if s.real is None else (k[s.real], v[s.real])
        kb.view(-1, *kb.shape[2:]).index_copy_(0, s.slots, k.to(kb.dtype))
        vb.view(-1, *vb.shape[2:]).index_copy_(0, s.slots, v.to(vb.dtype))
        return kb, vb


def attend_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The engine's gather-then-attend over whole pools, as ``cfx_kernels.paged_attention`` takes them (what
    ``paged_choice`` times against the kernel)."""
    pool = KVPool(k_pool.shape[0], k_pool.shape[1], 1)
    return PagedStep(pool, tables, starts, lengths, q.shape[1], "reference").attend_reference(q, k_pool, v_pool)
