"""Attention in plain PyTorch: the specification the flash-attention kernel must equal.

``softmax(q k^T * scale + bias) v`` per head, computed in fp32 (fp64 for fp64 inputs) with the
scores materialised, so it is exact against naive math and supports everything the kernel does:
grouped-query attention, bottom-right aligned causal masking, a bool or additive mask, and
zeros (not NaN) for a query that may see no key. Also home of the input checks both paths share.
"""
from __future__ import annotations

import math

import torch

__all__ = ["QUERY_TILE", "allowed_keys", "attention_block_backward_reference", "attention_block_reference",
           "attention_reference", "check_inputs"]


def _err(msg: str) -> ValueError:
    return ValueError(f"cfx_kernels.flash_attention: {msg}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 mask: torch.Tensor | None = None, scale: float | None = None) -> None:
    """``ValueError`` naming the argument for anything neither implementation accepts."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _err(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise _err(f"{name} must be 4-D (B, T or S, heads, head_dim), got shape {tuple(t.shape)}.")
        if not t.is_floating_point():
            raise _err(f"{name} must be a floating-point tensor, got dtype {t.dtype}.")
        if t.numel() == 0:
            raise _err(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be positive.")
    if not (q.dtype == k.dtype == v.dtype):
        raise _err(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise _err(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}.")
    if k.shape != v.shape:
        raise _err(f"k and v must have the same shape (B, S, Hkv, D), got k {tuple(k.shape)} "
                   f"and v {tuple(v.shape)}.")
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B:
        raise _err(f"batch sizes differ: q has {B}, k and v have {k.shape[0]}.")
    if k.shape[3] != D:
        raise _err(f"head_dim differs: q has {D}, k and v have {k.shape[3]}.")
    if H % Hkv:
        raise _err(f"q has {H} heads, not a multiple of k's {Hkv} kv heads (grouped-query "
                   f"attention needs H % Hkv == 0).")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise _err(f"mask must be a torch.Tensor or None, got {type(mask).__name__}.")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise _err(f"mask must be bool (True = attend) or floating point (added to the "
                       f"scaled scores), got dtype {mask.dtype}.")
        if tuple(mask.shape) not in ((B, S), (B, T, S)):
            raise _err(f"mask must have shape (B, S) = {(B, S)} or (B, T, S) = {(B, T, S)}, "
                       f"got {tuple(mask.shape)}.")
        if mask.requires_grad:
            raise _err("mask requires grad, but no gradient flows to an additive mask; pass "
                       "mask.detach().")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise _err(f"scale must be a finite float or None, got {scale!r}.")


def allowed_keys(mask: torch.Tensor | None, causal: bool, T: int, S: int,
                 device: torch.device, rows: range | None = None) -> torch.Tensor | None:
    """Which keys each query may see, bool ``(B|1, 1|T, S)``; None for all of them. ``rows``:
    only those queries of the ``T`` (a tile), ``(B|1, 1|len(rows), S)``.

    A float mask's ``-inf`` entries count as not allowed.
    """
    rows = range(T) if rows is None else rows
    allowed = None
    if mask is not None:
        mask = mask.to(device)
        allowed = mask if mask.dtype == torch.bool else torch.isfinite(mask)
        allowed = allowed[:, None, :] if allowed.dim() == 2 else allowed[:, rows.start:rows.stop]  # (B, 1|T, S)
    if causal:
        # Bottom-right aligned: query i sits at key position i + (S - T) (as in a kv-cache).
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        tri = (j <= i + (S - T))[None]  # (1, T, S)
        allowed = tri if allowed is None else allowed & tri
    return allowed


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q ``(B, T, H, D)``, k/v ``(B, S, Hkv, D)`` -> ``(B, T, H, D)`` in q's dtype.

    Query head ``h`` reads kv head ``h // (H // Hkv)``. ``causal``: query ``i`` sees keys
    ``j <= i + S - T``. ``mask``: bool ``(B, S)`` / ``(B, T, S)`` (True = attend) or a float
    mask of those shapes added to the scaled scores. ``scale`` defaults to ``1/sqrt(D)``.
    """
    check_inputs(q, k, v, mask=mask, scale=scale)
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    ct = torch.promote_types(q.dtype, torch.float32)  # compute dtype
    q_ = q.to(ct).transpose(1, 2)  # (B, H, T, D)
    k_ = k.to(ct).transpose(1, 2)[:, :, None].expand(B, Hkv, G, S, D).reshape(B, H, S, D)
    v_ = v.to(ct).transpose(1, 2)[:, :, None].expand(B, Hkv, G, S, D).reshape(B, H, S, D)
    s = torch.matmul(q_, k_.transpose(-1, -2)).mul_(scale)  # (B, H, T, S)
    allowed = allowed_keys(mask, causal, T, S, q.device)  # (B|1, 1|T, S) or None
    seen = None
    if mask is not None or (causal and T > S):  # otherwise every query sees a key
        seen = allowed.any(dim=-1, keepdim=True)  # (B|1, 1|T, 1): False = the query sees no key
        allowed = allowed | ~seen  # such a row attends everywhere (a finite softmax), zeroed below
    if mask is not None and mask.is_floating_point():
        bias = mask.to(device=q.device, dtype=ct)
        bias = bias.masked_fill(~torch.isfinite(bias), 0.0)  # -inf is in `allowed` already
        s = s + (bias[:, None, :] if bias.dim() == 2 else bias)[:, None]
    if allowed is not None:
        s = s.masked_fill_(~allowed[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), v_)  # (B, H, T, D)
    if seen is not None:
        out = out.masked_fill(~seen[:, None], 0.0)
    return out.transpose(1, 2).to(q.dtype)  # (B, T, H, D)


QUERY_TILE = 32  # queries per step of the block functions below: their scores take O(tile x S), not O(T x S)


def _query_tiles(T: int) -> list[range]:
    return [range(t, min(t + QUERY_TILE, T)) for t in range(0, T, QUERY_TILE)]


def _block_scores(q, k, mask, causal, scale, rows: range):
    """fp32 scaled scores (B, H, t, S) of the queries ``rows`` of ``q`` (B, T, H, D), with
    disallowed keys at -inf, for the block functions below (bool masks only)."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    q_ = q[:, rows.start:rows.stop].to(ct).transpose(1, 2)                           # (B, H, t, D)
    k_ = k.to(ct).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)                 # (B, H, S, D)
    s = torch.matmul(q_, k_.transpose(-1, -2)).mul_(scale)                           # (B, H, t, S)
    allowed = allowed_keys(mask, causal, T, S, q.device, rows)                       # (B|1, 1|t, S)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    return s


def attention_block_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                              mask: torch.Tensor | None = None,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the attention of ``q`` over this block of keys, and each query's
    log-sum-exp of its scaled scores over the block, ``(B, H, T)`` fp32, natural log, ``-inf``
    for a query that sees no key of the block (whose ``out`` is 0). Blocks combine by
    ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``
    (ring attention). Bool masks only. Queries go ``QUERY_TILE`` at a time, so the scores never
    take more than a tile's rows (memory O(T + tile x S), as a flash kernel's)."""
    check_inputs(q, k, v, mask=mask, scale=scale)
    D, H, Hkv = q.shape[3], q.shape[2], k.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    v_ = v.to(torch.promote_types(q.dtype, torch.float32)).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    outs, lses = [], []                                                              # v_: (B, H, S, D)
    for rows in _query_tiles(q.shape[1]):
        s = _block_scores(q, k, mask, causal, scale, rows)                           # (B, H, t, S)
        lse = torch.logsumexp(s, dim=-1)                                             # (B, H, t)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])    # 0 where masked
        outs.append(torch.matmul(p, v_).transpose(1, 2).to(q.dtype))                 # (B, t, H, D)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def attention_block_backward_reference(q, k, v, out, lse, dout, *, causal: bool,
                                       mask: torch.Tensor | None = None, scale: float | None = None):
    """``(dq, dk, dv)`` of this block's share of an attention whose *whole* output is ``out``
    ``(B, T, H, D)`` with log-sum-exp ``lse`` ``(B, H, T)`` over every block (natural log):
    ``p = exp(s - lse)`` is the block's slice of the full softmax, ``ds = p * (dp - rowsum(dout * out))``.
    Summing over the blocks gives the full attention's gradients (ring attention's backward).
    Queries go ``QUERY_TILE`` at a time, as in the forward."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    ct = torch.promote_types(q.dtype, torch.float32)
    v_ = v.to(ct).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)                 # (B, H, S, D)
    k_ = k.to(ct).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    dqs, dk, dv = [], 0, 0
    for rows in _query_tiles(T):
        tile = slice(rows.start, rows.stop)
        s = _block_scores(q, k, mask, causal, scale, rows)                           # (B, H, t, S)
        p = torch.exp(s - lse[..., tile].masked_fill(lse[..., tile] == float("-inf"), 0.0)[..., None])
        do_ = dout[:, tile].to(ct).transpose(1, 2)                                   # (B, H, t, D)
        delta = (do_ * out[:, tile].to(ct).transpose(1, 2)).sum(-1, keepdim=True)    # (B, H, t, 1)
        ds = p * (torch.matmul(do_, v_.transpose(-1, -2)) - delta) * scale          # (B, H, t, S)
        dqs.append(torch.matmul(ds, k_).transpose(1, 2))                             # (B, t, H, D)
        q_ = q[:, tile].to(ct).transpose(1, 2)
        dk = dk + torch.matmul(ds.transpose(-1, -2), q_)                             # (B, H, S, D)
        dv = dv + torch.matmul(p.transpose(-1, -2), do_)
    dq = torch.cat(dqs, dim=1)
    G = H // Hkv  # grouped-query: the query heads of one kv head add up
    dk = dk.view(B, Hkv, G, -1, D).sum(2).transpose(1, 2)                            # (B, S, Hkv, D)
    dv = dv.view(B, Hkv, G, -1, D).sum(2).transpose(1, 2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
