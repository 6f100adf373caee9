"""Ring self-attention (Li et al., 2021; Liu et al., 2023) over a sequence-parallel mesh axis.

Inside ``shard_map`` each of the axis's N ranks holds T/N positions of the sequence: its queries
stay put, and its keys and values travel round the ring (``ppermute`` to the next rank) while
every rank attends its queries to the block it holds. Blocks combine by their log-sum-exp (the
flash-attention accumulation), so no rank ever holds more than two key/value blocks or the
(T/N)^2 scores of one pair of blocks: activation memory O(T/N) per rank. The backward is a ring
too: keys and values go round again with their gradient accumulators, which arrive home after
the last step (N - 1 hops of k/v, N of their gradients).

Causal attention with a contiguous split leaves rank 0 idle after one block and rank N-1 busy
for all N, so the default ``layout="zigzag"`` cuts the sequence into 2N chunks and gives rank
``r`` chunks ``r`` and ``2N-1-r`` (``zigzag_indices`` is the permutation): then at every step
each rank computes exactly half a block pair (Brandon et al., 2023, "striped"/zigzag balancing).
A key-padding mask travels with its keys (BERT).

The block compute is ``cfx_kernels.attention_blocks.flash_attention_block`` (Triton on CUDA, the plain-PyTorch
reference elsewhere) and its backward ``flash_attention_block_backward``.
"""
from __future__ import annotations

import torch

from cfx._src.lax import collectives as lax
from cfx._src.lax import comm, groups
from cfx_kernels.attention_blocks import flash_attention_block, flash_attention_block_backward

LAYOUTS = ("zigzag", "contiguous")


def zigzag_indices(length: int, n: int) -> torch.Tensor:
    """The permutation of ``range(length)`` that, split into n contiguous parts, gives part ``r``
    the chunks ``r`` and ``2n-1-r`` of ``2n`` equal chunks: ``x[:, zigzag_indices(T, n)]`` before
    sharding over the axis, and ``zigzag_indices(T, n).view(n, -1)[r]`` are rank r's positions."""
    if length % (2 * n):
        raise ValueError(f"zigzag_indices: a sequence of {length} positions does not split into 2 x {n} "
                         f"equal chunks; pad it to a multiple of {2 * n}, or use layout='contiguous'.")
    chunks = torch.arange(length).view(2 * n, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def _pairs(r: int, src: int, tl: int, causal: bool, layout: str):
    """What rank ``r``'s queries do with the key block of rank ``src``: ``(q rows, kv cols,
    causal)`` as slices of the local blocks of ``tl`` positions, or None (nothing visible)."""
    every = slice(0, tl)
    if not causal:
        return every, every, False
    if src == r:
        return every, every, True   # the own block: positions increase along it in both layouts
    if layout == "contiguous":
        return (every, every, False) if src < r else None
    half = tl // 2                  # zigzag: chunks (r, 2n-1-r) against (src, 2n-1-src)
    if src < r:
        return every, slice(0, half), False   # both my chunks see its first, neither its second
    return slice(half, tl), every, False      # only my second chunk sees it, all of it


def _combine(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Online softmax: two partial attentions (B, T, H, D) with their lse (B, H, T) as one."""
    new = torch.logaddexp(lse, lse_b)
    w = torch.exp(lse - new).nan_to_num_(0.0).transpose(1, 2)[..., None]      # (B, T, H, 1); -inf - -inf -> 0
    w_b = torch.exp(lse_b - new).nan_to_num_(0.0).transpose(1, 2)[..., None]
    return o * w + o_b.float() * w_b, new


def _around(k, v, mask, ax, r, tl, causal, layout):
    """The ring's steps on rank ``r``: ``(pair, k, v, mask)`` with the key block held at that
    step (its own first, then the previous rank's, ...) and what to do with it (``_pairs``); the
    block moves on between steps."""
    n, ring = ax.size, [(i, (i + 1) % ax.size) for i in range(ax.size)]
    kv = torch.stack([k, v])                                                       # (2, B, Tl, Hkv, D)
    for s in range(n):
        yield _pairs(r, (r - s) % n, tl, causal, layout), kv[0], kv[1], mask
        if s < n - 1:  # pass the block on; receive the previous rank's
            kv = comm.permute(kv, ax, ring)
            mask = None if mask is None else comm.permute(mask, ax, ring)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, ax, r, causal, scale, layout, impl):
        B, tl, H, _ = q.shape
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)           # (B, Tl, H, D)
        lse = torch.full((B, H, tl), float("-inf"), device=q.device)             # (B, H, Tl)
        for pair, kb, vb, m in _around(k, v, mask, ax, r, tl, causal, layout):
            if pair is not None:
                rows, cols, c = pair
                o_b, lse_b = flash_attention_block(q[:, rows], kb[:, cols], vb[:, cols], causal=c,
                                                   mask=None if m is None else m[:, cols], scale=scale, impl=impl)
                o[:, rows], lse[:, :, rows] = _combine(o[:, rows], lse[:, :, rows], o_b, lse_b)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = (ax, r, causal, scale, layout, impl)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        ax, r, causal, scale, layout, impl = ctx.args
        n, tl = ax.size, q.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)   # travels with its block
        ring = [(i, (i + 1) % n) for i in range(n)]
        for pair, kb, vb, m in _around(k, v, mask, ax, r, tl, causal, layout):
            if pair is not None:
                rows, cols, c = pair
                dq_b, dk_b, dv_b = flash_attention_block_backward(
                    q[:, rows], kb[:, cols], vb[:, cols], out[:, rows], lse[:, :, rows], dout[:, rows],
                    causal=c, mask=None if m is None else m[:, cols], scale=scale, impl=impl)
                dq[:, rows] += dq_b
                dkv[0][:, cols] += dk_b
                dkv[1][:, cols] += dv_b
            dkv = comm.permute(dkv, ax, ring)  # after the last step: home to its block's owner
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str = "seq", *, causal: bool = True,
                   mask: torch.Tensor | None = None, scale: float | None = None, layout: str = "zigzag",
                   impl: str = "auto") -> torch.Tensor:
    """Self-attention over a sequence split along mesh ``axis``, inside ``shard_map``.

    ``q`` ``(B, T/N, H, D)``, ``k`` / ``v`` ``(B, T/N, Hkv, D)``: this rank's positions of the
    sequence (in ``layout`` order: ``"zigzag"``, see ``zigzag_indices``, or ``"contiguous"``);
    ``mask``: bool ``(B, T/N)`` key padding of this rank's positions (True = real token). Returns
    this rank's ``(B, T/N, H, D)``: what ``cfx.nn.attention`` over the whole sequence gives at
    these positions. ``layout`` matters only for ``causal``."""
    where = "cfx.parallel.ring_attention"
    if not isinstance(axis, str):
        raise ValueError(f"{where}: axis must be one mesh axis name, got {axis!r}.")
    ax = groups.axes((axis,), where)
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-D tensor (B, T/N, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if k.shape[:2] != q.shape[:2] or k.shape != v.shape:
        raise ValueError(f"{where}: self-attention needs q, k and v over the same local positions, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(q.shape[:2])):
        raise ValueError(f"{where}: mask must be a bool key-padding mask (B, T/N) = {tuple(q.shape[:2])} of this "
                         f"rank's positions, got {mask.dtype} {tuple(mask.shape)}.")
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{where}: the zigzag layout gives each rank two equal chunks, but this rank holds "
                         f"{q.shape[1]} positions; make the sequence a multiple of 2 x {ax.size}.")
    r = lax.axis_index(axis)
    return _Ring.apply(q, k, v, mask, ax, r, bool(causal), scale, layout, impl)
