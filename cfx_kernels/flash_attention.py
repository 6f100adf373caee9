"""Flash attention (FlashAttention-2 tiling) in Triton, forward and backward.

The forward walks the keys block by block with an online softmax and saves only the output and
one log-sum-exp per query row, so memory is O(T + S), never O(T * S). The backward recomputes the
probabilities from that log-sum-exp: one kernel per key block accumulates dK and dV over every
query head of its GQA group (no atomics), another per query block accumulates dQ.

Layout and meaning equal :func:`cfx_kernels.attention_reference.attention_reference`, which is
also what ``impl="auto"`` runs off CUDA. Kernels are decorated at their first launch
(``cfx_kernels._jit.lazy_jit``), so ``TRITON_INTERPRET=1`` set any time before a call runs them
through the Triton interpreter on CPU tensors.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cfx_kernels._common import device_capability, interpret_mode, on_device, resolve_impl
from cfx_kernels._jit import device_function, lazy_jit
from cfx_kernels.attention_reference import attention_reference, check_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; resolve_impl never picks Triton then
    triton = tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
_NO_MASK, _BOOL_MASK, _ADD_MASK = 0, 1, 2
_LOG2E = 1.4426950408889634

__all__ = ["flash_attention", "triton_unsupported"]

# ----------------------------------------------------------------------------- kernels
# Shared arguments: contiguous tensors in (B, T|S, heads, D), strides passed per
# tensor; LSE and DELTA are (B, H, T) fp32. Scores live in the log2 domain (qk_scale = scale *
# log2(e)) so exp2 is used throughout. A masked score is -inf; a row whose scores are all -inf
# gets l = 0, output 0 and LSE 0, so its probabilities recompute to exp2(-inf) = 0 in backward.

@device_function
def _tile_scores(q, kT, M, offs_m, offs_n, T, S, stride_mt, stride_ms, qk_scale,
                 CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Scaled, masked log2-domain scores of one tile, the same in all three kernels: queries
    ``offs_m`` (BM,) of q (BM, BD) against keys ``offs_n`` (BN,) of kT (BD, BN); M is the mask
    already offset to this batch row. Returns (BM, BN) fp32, -inf where a key is not seen."""
    s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # (BM, BN)
    valid = (offs_m[:, None] < T) & (offs_n[None, :] < S)  # (BM, BN)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + (S - T))
    if MASK_KIND != 0:
        if MASK_ROWS:  # (B, T, S): a tile per block
            mval = tl.load(M + offs_m[:, None] * stride_mt + offs_n[None, :] * stride_ms,
                           mask=valid, other=0)  # (BM, BN)
        else:  # (B, S) key padding: one row, broadcast over the queries
            mval = tl.load(M + offs_n * stride_ms, mask=offs_n < S, other=0)[None, :]  # (1, BN)
        if MASK_KIND == 1:
            valid = valid & (mval != 0)
        else:
            s = s + mval.to(tl.float32) * 1.4426950408889634  # log2(e)
    return tl.where(valid, s, float("-inf"))


@lazy_jit
def _fwd_kernel(Q, K, V, M, O, LSE,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh,
                stride_mb, stride_mt, stride_ms,
                H, T, S, D, GROUP, qk_scale,
                CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < T) & d_ok[None, :], other=0.0)  # (BM, BD)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    M += b * stride_mb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if CAUSAL:  # the last key any row of this block may see, +1
        hi = tl.minimum(S, start_m + BLOCK_M + S - T)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_ok = offs_n < S
        kT = tl.load(K + offs_n[None, :] * stride_ks + offs_d[:, None],
                     mask=kv_ok[None, :] & d_ok[:, None], other=0.0)  # (BD, BN)
        s = _tile_scores(q, kT, M, offs_m, offs_n, T, S, stride_mt, stride_ms, qk_scale,
                         CAUSAL, MASK_KIND, MASK_ROWS, PRECISION)  # (BM, BN)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs_n[:, None] * stride_vs + offs_d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)  # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, 0.0, m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m[:, None] < T) & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


@lazy_jit
def _bwd_dkdv_kernel(Q, K, V, M, DO, LSE, DELTA, DK, DV,
                     stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_dob, stride_dot, stride_doh,
                     stride_mb, stride_mt, stride_ms,
                     H, T, S, D, GROUP, qk_scale, sm_scale,
                     CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    # One program: BLOCK_N keys of one kv head, summed over the GROUP query heads reading it.
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    Hkv = H // GROUP
    b = (bhk // Hkv).to(tl.int64)
    hk = bhk % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = (offs_n[:, None] < S) & d_ok[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)  # (BN, BD)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=kv_mask, other=0.0)  # (BN, BD)
    M += b * stride_mb
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # the first query that may see key start_n, rounded down to a block
        lo = tl.maximum(0, start_n - (S - T)) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        row = (b * H + h) * T  # into LSE / DELTA
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + offs_m0
            q_mask = (offs_m[:, None] < T) & d_ok[None, :]
            q = tl.load(Qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DOh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=offs_m < T, other=0.0)
            s = _tile_scores(q, tl.trans(k), M, offs_m, offs_n, T, S, stride_mt, stride_ms, qk_scale,
                             CAUSAL, MASK_KIND, MASK_ROWS, PRECISION)  # (BM, BN)
            p = tl.math.exp2(s - lse[:, None])  # (BM, BN)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    dk = dk * sm_scale
    out_mask = (offs_n[:, None] < S) & d_ok[None, :]
    tl.store(DK + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=out_mask)


@lazy_jit
def _bwd_dq_kernel(Q, K, V, M, DO, LSE, DELTA, DQ,
                   stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_dob, stride_dot, stride_doh,
                   stride_mb, stride_mt, stride_ms,
                   H, T, S, D, GROUP, qk_scale, sm_scale,
                   CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    # One program: BLOCK_M query rows of one head, walking the keys like the forward.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_mask = (offs_m[:, None] < T) & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=q_mask, other=0.0)  # (BM, BD)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=q_mask, other=0.0)  # (BM, BD)
    row = bh.to(tl.int64) * T
    lse = tl.load(LSE + row + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < T, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    M += b * stride_mb
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, start_m + BLOCK_M + S - T)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[None, :] < S) & d_ok[:, None]
        kT = tl.load(K + offs_n[None, :] * stride_ks + offs_d[:, None], mask=kv_mask, other=0.0)
        vT = tl.load(V + offs_n[None, :] * stride_vs + offs_d[:, None], mask=kv_mask, other=0.0)
        s = _tile_scores(q, kT, M, offs_m, offs_n, T, S, stride_mt, stride_ms, qk_scale,
                         CAUSAL, MASK_KIND, MASK_ROWS, PRECISION)  # (BM, BN)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, vT, input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------- launch


def triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these (already checked) inputs; None when it can."""
    del k, v  # check_inputs made their dtype and head_dim equal q's
    if triton is None:
        return "the triton package is not installed"
    if q.dtype not in DTYPES:
        return (f"dtype {q.dtype} of q, k, v is not supported by the Triton kernel (float32, "
                f"float16, bfloat16); use impl='reference'")
    if q.shape[3] > MAX_HEAD_DIM:
        return (f"head_dim {q.shape[3]} (q.shape[3]) is not supported by the Triton kernel (at "
                f"most {MAX_HEAD_DIM}); use impl='reference'")
    return None


def _blocks(head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> SimpleNamespace:
    """Tile sizes per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages).

    Chosen by compiling ahead of time for sm80 and sm90 and keeping configs that spill no
    registers (``cuobjdump -res-usage``). The 16-bit backward's on sm90 were timed on an H200
    (``python -m cfx.bench gpu --all``'s tile sweep, bf16 causal, T 4096, 16K tokens, 2026-11-28): the
    whole backward took 1.61 / 1.27 ms (D 64 / 128) with dk/dv 64 x 64 x 4 warps (3 stages / 2 stages)
    and dq 64 x 64 x 4 warps / 128 x 64 x 8 warps, against 2.94 / 3.15 ms with the untimed tiles
    (dk/dv 32 x 32 / 32 x 64, dq 64 x 32 / 32 x 64). Other GPUs keep the untimed tiles.
    """
    if interpret_mode():  # tiny tiles keep the interpreter fast; 16 is tl.dot's minimum
        return SimpleNamespace(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1))
    small = head_dim <= 64
    if dtype == torch.float32:  # "ieee" dots run on FMA units: smaller tiles
        return SimpleNamespace(fwd=(32, 32, 4, 2) if small else (32, 16, 8, 1),
                               dkdv=(32, 32, 8, 1) if small else (16, 32, 8, 1),
                               dq=(32, 32, 8, 2))
    fwd = (128, 64, 8, 3) if small else (64, 64, 4, 3)
    if device is not None and device_capability(device.index)[0] == 9:
        return SimpleNamespace(fwd=fwd, dkdv=(64, 64, 4, 3) if small else (64, 64, 4, 2),
                               dq=(64, 64, 4, 3) if small else (128, 64, 8, 3))
    return SimpleNamespace(fwd=fwd, dkdv=(32, 32, 4, 3) if small else (32, 64, 8, 3),
                           dq=(64, 32, 8, 3) if small else (32, 64, 8, 3))


def _mask_arg(mask: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, int, tuple]:
    """(tensor the kernel reads, MASK_KIND, (stride_b, stride_t, stride_s)); (B, S): stride_t 0."""
    if mask is None:
        return q, _NO_MASK, (0, 0, 0)
    mask = mask.to(q.device)
    kind = _BOOL_MASK if mask.dtype == torch.bool else _ADD_MASK
    if kind == _BOOL_MASK:
        mask = mask.view(torch.uint8)
    if mask.dim() == 2:
        return mask, kind, (mask.stride(0), 0, mask.stride(1))
    return mask, kind, tuple(mask.stride())


def _precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's own matmul setting: TF32 only when the user allowed it.
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _common_args(q, k, v, mask, causal):
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    m, kind, m_strides = _mask_arg(mask, q)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    sizes = (H, T, S, D, H // Hkv)
    consts = dict(CAUSAL=bool(causal), MASK_KIND=kind, MASK_ROWS=mask is not None and mask.dim() == 3,
                  PRECISION=_precision(q.dtype), BLOCK_D=max(16, triton.next_power_of_2(D)))
    return m, strides, m_strides, sizes, consts


def _forward(q, k, v, mask, causal, scale):
    B, T, H, D = q.shape
    m, strides, m_strides, sizes, consts = _common_args(q, k, v, mask, causal)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, T, H, D)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    BM, BN, warps, stages = _blocks(D, q.dtype, q.device).fwd
    grid = (triton.cdiv(T, BM), B * H)
    _fwd_kernel[grid](q, k, v, m, o, lse, *strides, *o.stride()[:3], *m_strides, *sizes,
                      scale * _LOG2E, BLOCK_M=BM, BLOCK_N=BN, num_warps=warps, num_stages=stages,
                      **consts)
    return o, lse


def _backward(q, k, v, mask, o, lse, do, causal, scale, blocks: SimpleNamespace | None = None):
    """dq, dk, dv; ``blocks`` overrides ``_blocks``' tiles (the bench's tile sweep)."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    m, strides, m_strides, sizes, consts = _common_args(q, k, v, mask, causal)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()  # (B, H, T) rowsum(dO*O)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    # The kernels write dq with q's strides and dk/dv with k's/v's: all are contiguous.
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    blocks = blocks or _blocks(D, q.dtype, q.device)
    args = (*strides, *do.stride()[:3], *m_strides, *sizes, scale * _LOG2E, scale)
    BM, BN, warps, stages = blocks.dkdv
    grid = (triton.cdiv(S, BN), B * Hkv)  # one program per key block and kv head
    _bwd_dkdv_kernel[grid](q, k, v, m, do, lse, delta, dk, dv, *args, BLOCK_M=BM, BLOCK_N=BN,
                           num_warps=warps, num_stages=stages, **consts)
    BM, BN, warps, stages = blocks.dq
    grid = (triton.cdiv(T, BM), B * H)  # one program per query block and head
    _bwd_dq_kernel[grid](q, k, v, m, do, lse, delta, dq, *args, BLOCK_M=BM, BLOCK_N=BN,
                         num_warps=warps, num_stages=stages, **consts)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):
        with on_device(q):
            o, lse = _forward(q, k, v, mask, causal, scale)
        ctx.save_for_backward(q, k, v, mask, o, lse)  # O(T + S) per head: no (T, S) matrix
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask, o, lse = ctx.saved_tensors
        with on_device(q):
            dq, dk, dv = _backward(q, k, v, mask, o, lse, do.contiguous(), ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    mask: torch.Tensor | None = None, scale: float | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head; q ``(B, T, H, D)``, k/v ``(B, S, Hkv, D)``.

    Same meaning as ``cfx.nn.attention``: query head ``h`` reads kv head ``h // (H // Hkv)``;
    ``causal`` lets query ``i`` see keys ``j <= i + S - T``; ``mask`` is bool ``(B, S)`` or
    ``(B, T, S)`` (True = attend) or a float mask of those shapes added to the scaled scores (no
    gradient flows to it); ``scale`` defaults to ``1/sqrt(D)``; a query that sees no key returns
    zeros. Returns ``(B, T, H, D)`` in q's dtype.

    ``impl``: ``"triton"`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``; float32/16/bf16,
    head_dim <= 128), ``"reference"`` (:func:`attention_reference`, any float dtype), or
    ``"auto"``: Triton when the tensors are on CUDA and the kernel takes them, else the reference.
    """
    check_inputs(q, k, v, mask=mask, scale=scale)
    which = resolve_impl(impl, q, k, v)
    reason = triton_unsupported(q, k, v) if which == "triton" else None
    if reason is not None and impl == "triton":
        raise ValueError(f"cfx_kernels.flash_attention: {reason}.")
    if which == "reference" or reason is not None:
        return attention_reference(q, k, v, causal=causal, mask=mask, scale=scale)
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, T|S, heads, D)
    return _FlashAttention.apply(q, k, v, mask, bool(causal), scale)

