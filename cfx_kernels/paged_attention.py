"""Paged attention (vLLM's PagedAttention), forward only: queries attend over keys and values kept in a
pool of fixed-size blocks, read through each row's block table.

    out = paged_attention(q, k_pool, v_pool, tables, starts, lengths)   # (B, T, H, D)

``q`` ``(B, T, H, D)``: row ``b``'s new tokens, right-padded; ``k_pool`` / ``v_pool`` ``(NB, bs, Hkv, D)``;
``tables`` ``(B, nb)`` integer block ids; ``starts`` ``(B,)``: the tokens row ``b`` had cached before these;
``lengths`` ``(B,)``: how many of its ``T`` tokens are real. Token ``t`` of row ``b`` sits at position
``starts[b] + t`` and sees the keys at positions ``<= starts[b] + t`` (its own included: the caller wrote
the new keys into their slots first); position ``p`` lives in block ``tables[b, p // bs]``, slot
``p % bs``; query head ``h`` reads kv head ``h // (H // Hkv)``; padding tokens return zeros.

``paged_attention_reference`` gathers every row's blocks into ``(B, nb * bs, Hkv, D)`` and runs
``attention_reference`` under the ``(B, T, S)`` mask -- what ``cfx.serve`` runs on a CPU. The Triton kernel
reads the blocks in place: one program per (block of ``BLOCK_M`` queries, row, head) walks the row's
blocks up to the last one its queries see, with the online softmax of ``flash_attention``, so nothing of
the pool is copied. ``impl="auto"`` runs the kernel on CUDA and the reference elsewhere.
"""
from __future__ import annotations

import torch

from cfx_kernels._common import on_device, resolve_impl
from cfx_kernels._jit import lazy_jit
from cfx_kernels.attention_reference import attention_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; resolve_impl never picks Triton then
    triton = tl = None

__all__ = ["gather_blocks", "paged_attention", "paged_attention_reference", "paged_mask", "triton_unsupported"]

_LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@lazy_jit
def _paged_fwd_kernel(Q, KP, VP, TB, ST, LN, O,
                      stride_qb, stride_qt, stride_qh, stride_kn, stride_ks, stride_kh,
                      stride_vn, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh, stride_tb,
                      H, T, D, GROUP, qk_scale,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    start = tl.load(ST + b)
    length = tl.load(LN + b)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = (offs_m < length) & (offs_m < T)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
    pos = start + offs_m  # (BM,) each query's position in its sequence
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seen = start + tl.minimum(start_m + BLOCK_M, length)  # keys at positions < seen are read
    for j in range(0, tl.cdiv(seen, BS)):
        blk = tl.load(TB + b * stride_tb + j).to(tl.int64)
        kpos = j * BS + offs_s  # (BS,)
        kT = tl.load(KP + blk * stride_kn + hk * stride_kh + offs_s[None, :] * stride_ks + offs_d[:, None],
                     mask=d_ok[:, None], other=0.0)  # (BD, BS)
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # (BM, BS), log2 domain
        s = tl.where(row_ok[:, None] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VP + blk * stride_vn + hk * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :],
                    mask=d_ok[None, :], other=0.0)  # (BS, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=(offs_m[:, None] < T) & d_ok[None, :])


def paged_mask(tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, T: int, block_size: int
               ) -> torch.Tensor:
    """``(B, T, nb * bs)`` bool: which gathered key each real new token sees (module doc)."""
    t = torch.arange(T, device=tables.device)
    pos = starts[:, None] + t[None, :]  # (B, T)
    S = tables.shape[1] * block_size
    seen = torch.arange(S, device=tables.device)[None, None, :] <= pos[:, :, None]
    return seen & (t[None, :] < lengths[:, None])[:, :, None]


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``(B, nb * bs, Hkv, D)``: each row's blocks of ``pool`` ``(NB, bs, Hkv, D)``, in table order."""
    B, nb = tables.shape
    return pool[tables.reshape(-1)].reshape(B, nb * pool.shape[1], *pool.shape[2:])


def paged_attention_reference(q, k_pool, v_pool, tables, starts, lengths, *, scale: float | None = None,
                              mask: torch.Tensor | None = None) -> torch.Tensor:
    """The gather-then-attend reference (module doc); ``mask``: ``paged_mask``'s, if made already."""
    if mask is None:
        mask = paged_mask(tables, starts, lengths, q.shape[1], k_pool.shape[1])
    k, v = gather_blocks(k_pool, tables), gather_blocks(v_pool, tables)
    return attention_reference(q, k.to(q.dtype), v.to(q.dtype), causal=False, mask=mask, scale=scale)


def triton_unsupported(q: torch.Tensor, k_pool: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (the reference can), or None."""
    bs, D = k_pool.shape[1], q.shape[3]
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype:
        return f"the kernel takes float32/16/bf16 queries and a pool of the same dtype, not {q.dtype}/{k_pool.dtype}"
    if bs < 16 or bs & (bs - 1):
        return f"the kernel reads blocks of a power-of-two size >= 16 tokens, not {bs}"
    if D > 128:
        return f"head_dim {D} > 128"
    return None


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                    starts: torch.Tensor, lengths: torch.Tensor, *, scale: float | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """Attention of ``q`` over the paged keys and values (module doc); ``(B, T, H, D)`` in q's dtype.
    ``impl``: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"``, or ``"auto"``."""
    B, T, H, D = q.shape
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape or H % k_pool.shape[2] or k_pool.shape[3] != D:
        raise ValueError(f"cfx_kernels.paged_attention: q {tuple(q.shape)} against pools {tuple(k_pool.shape)} / "
                         f"{tuple(v_pool.shape)}: expected (NB, bs, Hkv, D) pools with H a multiple of Hkv.")
    which = resolve_impl(impl, q, k_pool, v_pool)
    reason = triton_unsupported(q, k_pool) if which == "triton" else None
    if reason is not None and impl == "triton":
        raise ValueError(f"cfx_kernels.paged_attention: {reason}.")
    if which == "reference" or reason is not None:
        return paged_attention_reference(q, k_pool, v_pool, tables, starts, lengths, scale=scale)
    scale = D ** -0.5 if scale is None else float(scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    tables, starts, lengths = tables.contiguous(), starts.contiguous(), lengths.contiguous()
    BLOCK_M = 16
    grid = (triton.cdiv(T, BLOCK_M), B * H)
    precision = "tf32" if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    with on_device(q):
        _paged_fwd_kernel[grid](q, k_pool, v_pool, tables, starts, lengths, out,
                                q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1),
                                k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
                                out.stride(0), out.stride(1), out.stride(2), tables.stride(0),
                                H, T, D, H // k_pool.shape[2], scale * _LOG2E,
                                PRECISION=precision, BLOCK_M=BLOCK_M, BS=k_pool.shape[1],
                                BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out
