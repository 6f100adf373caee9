"""Multi-head self-attention: the ``attention`` core and the ``Attention`` layer (GQA, RoPE)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.rope import apply_rope, rope_cos_sin
from cfx._src.nn.sublayers import keep_sublayers


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"cfx.nn.attention: {name} must be 4-D (B, T, heads, head_dim), "
                             f"got shape {tuple(t.shape)}.")
    if k.shape != v.shape:
        raise ValueError(f"cfx.nn.attention: k and v must have the same shape (B, S, Hkv, D), got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"cfx.nn.attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cfx.nn.attention: head_dim differs between q ({q.shape[3]}) and k "
                         f"({k.shape[3]}).")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"cfx.nn.attention: q has {q.shape[2]} heads, which is not a multiple of "
                         f"k's {k.shape[2]} kv heads (grouped-query attention needs H % Hkv == 0).")


def _allowed(mask: torch.Tensor | None, causal: bool, B: int, T: int, S: int,
             device: torch.device) -> torch.Tensor | None:
    """Which keys each query may see, ``(B, 1, T, S)`` bool, or None for "all of them"."""
    allowed = None
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"cfx.nn.attention: mask must be a bool tensor (True = attend), "
                             f"got dtype {mask.dtype}.")
        if mask.dim() == 2 and tuple(mask.shape) == (B, S):
            allowed = mask[:, None, None, :]  # (B, 1, 1, S)
        elif mask.dim() == 3 and tuple(mask.shape) == (B, T, S):
            allowed = mask[:, None, :, :]  # (B, 1, T, S)
        else:
            raise ValueError(f"cfx.nn.attention: mask must have shape (B, S) = {(B, S)} or "
                             f"(B, T, S) = {(B, T, S)}, got {tuple(mask.shape)}.")
        allowed = allowed.to(device)
    if causal:
        # Bottom-right aligned: query i sits at key position i + (S - T) (as in a kv-cache).
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        tri = j <= i + (S - T)  # (T, S)
        allowed = tri if allowed is None else allowed & tri
    return None if allowed is None else allowed.expand(B, 1, T, S)


_IMPLS = ("auto", "sdpa", "triton", "reference")


def _pick_impl(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               mask: torch.Tensor | None) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"cfx.nn.attention: impl must be one of {_IMPLS}, got {impl!r}.")
    if impl != "auto":
        return impl
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or torch.compiler.is_compiling():
        return "sdpa"  # (in a compiled graph: what the compiler knows, cfx_kernels.resolve_impl's rule)
    from cfx_kernels.flash_attention import triton_unsupported  # lazily: triton loads only here

    if triton_unsupported(q, k, v) is not None:
        return "sdpa"
    from cfx_kernels.attention_choice import choose

    return choose(q, causal=causal, masked=mask is not None)  # the faster one, as measured


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              mask: torch.Tensor | None = None, scale: float | None = None,
              impl: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` per head; q ``(B, T, H, D)``, k/v ``(B, S, Hkv, D)``.

    ``H`` must be a multiple of ``Hkv`` (grouped-query attention: query head ``h`` reads kv head
    ``h // (H // Hkv)``). ``causal`` lets query ``i`` see keys ``j <= i + S - T``; ``mask`` is a
    bool ``(B, S)`` key-padding mask or ``(B, T, S)`` mask, True = attend. ``scale`` defaults to
    ``1/sqrt(D)``. A query that may see no key at all returns zeros, not NaN. Returns
    ``(B, T, H, D)``. This is the one function attention kernels plug into.

    ``impl``: ``"sdpa"`` (``F.scaled_dot_product_attention``), ``"triton"`` (the flash-attention
    kernel of ``cfx_kernels.flash_attention``), ``"reference"`` (its plain-PyTorch reference), or
    ``"auto"``: on CUDA the faster of the two for the device, as measured
    (``cfx_kernels.attention_choice``: SDPA wherever nothing measured says the Triton kernel wins),
    SDPA elsewhere.
    """
    _check_qkv(q, k, v)
    impl = _pick_impl(impl, q, k, v, causal=causal, mask=mask)
    if impl in ("triton", "reference"):
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError(f"cfx.nn.attention: mask must be a bool tensor (True = attend), "
                             f"got dtype {mask.dtype}.")
        from cfx_kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, mask=mask, scale=scale, impl=impl)
    B, T = q.shape[:2]
    S = k.shape[1]
    if mask is None and (not causal or T == S or T == 1):  # one query at the end sees every key
        is_causal = False
        if causal and T > 1:  # a branch, not a value: under dynamic shapes a guard on T, not a SymBool argument
            is_causal = True
        out = F.scaled_dot_product_attention(*_heads_first(q, k, v), is_causal=is_causal, scale=scale)
        return out.transpose(1, 2)  # (B, T, H, D)
    return masked_sdpa(q, k, v, *sdpa_mask(_allowed(mask, causal, B, T, S, q.device)), scale=scale)


def sdpa_mask(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``allowed`` ``(B, 1, T, S)`` bool (True = attend) as SDPA's mask, and the queries that may see no
    key ``(B, 1, T, 1)``: those attend everywhere (a finite softmax), and ``masked_sdpa`` zeroes them."""
    row_ok = allowed.any(dim=-1, keepdim=True)
    return allowed | ~row_ok, ~row_ok


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                blind: torch.Tensor | None, *, scale: float | None = None) -> torch.Tensor:
    """``attention``'s masked path: ``q`` ``(B, T, H, D)`` over ``k``, ``v`` ``(B, S, Hkv, D)`` under
    ``sdpa_mask``'s ``mask``, the ``blind`` queries' outputs zero (None: no query is). A caller attending
    many times under one mask (the serving engine's layers) makes it once."""
    out = F.scaled_dot_product_attention(*_heads_first(q, k, v), attn_mask=mask, scale=scale)
    if blind is not None:
        out = out.masked_fill(blind, 0.0)
    return out.transpose(1, 2)  # (B, T, H, D)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(B, H, T, D)`` queries and ``(B, H, S, D)`` keys and values, as SDPA takes them: each kv head
    repeated for the query heads that read it (grouped-query attention)."""
    H, Hkv = q.shape[2], k.shape[2]
    q_, k_, v_ = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if Hkv != H:
        k_, v_ = k_.repeat_interleave(H // Hkv, dim=1), v_.repeat_interleave(H // Hkv, dim=1)
    return q_, k_, v_


@dataclasses.dataclass(frozen=True)
class Attention:
    """Self-attention with separate ``q``, ``k``, ``v``, ``o`` ``Linear`` projections.

    ``n_kv_heads < n_heads`` gives grouped-query attention; ``rope=True`` rotates q and k (HF
    Llama convention, base ``rope_theta``). ``apply(params, x, mask=None, positions=None)`` with
    x ``(B, T, C)``, an optional bool ``(B, T)`` padding mask (True = real token) and optional
    integer ``positions`` ``(T,)`` / ``(B, T)`` for RoPE (default ``arange(T)``). ``impl`` picks
    the attention implementation (see :func:`attention`).
    """

    features: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    bias: bool = True
    causal: bool = True
    rope: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    out_init_std: float | None = None
    impl: str = "auto"
    seq: Any = None  # a cfx.parallel SequenceSplit: the sequence is split over a mesh axis

    def __post_init__(self):
        if self.n_heads <= 0 or self.kv_heads <= 0:
            raise ValueError(f"Attention: n_heads and n_kv_heads must be positive, got "
                             f"{self.n_heads} and {self.kv_heads}.")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"Attention: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.kv_heads}.")
        if self.head_dim is None and self.features % self.n_heads:
            raise ValueError(f"Attention: features={self.features} is not divisible by "
                             f"n_heads={self.n_heads}; pass head_dim explicitly.")
        if self.impl not in _IMPLS:
            raise ValueError(f"Attention: impl must be one of {_IMPLS}, got {self.impl!r}.")
        if self.rope and self.dim % 2:
            raise ValueError(f"Attention: rope needs an even head_dim, got {self.dim}.")
        keep_sublayers(self, self._build_layers())

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dim(self) -> int:
        return self.features // self.n_heads if self.head_dim is None else self.head_dim

    def _layers(self) -> dict:
        return self._sublayers

    def _build_layers(self) -> dict:
        C, D = self.features, self.dim
        out_std = self.init_std if self.out_init_std is None else self.out_init_std
        kw = dict(bias=self.bias, init_std=self.init_std)
        return {
            "q": Linear(C, self.n_heads * D, axes_names=("embed", "heads"), **kw),
            "k": Linear(C, self.kv_heads * D, axes_names=("embed", "kv_heads"), **kw),
            "v": Linear(C, self.kv_heads * D, axes_names=("embed", "kv_heads"), **kw),
            "o": Linear(self.n_heads * D, C, axes_names=("heads", "embed"), bias=self.bias,
                        init_std=out_std),
        }

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        return {n: layer.init(k) for (n, layer), k in zip(layers.items(), split_keys(key, len(layers)))}

    def apply(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        out = self.heads(params, x, mask=mask, positions=positions, cache=cache)  # (B, T, H * D)
        return self._layers()["o"].apply(params["o"], out)  # (B, T, C)

    def heads(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Every head's output, concatenated, before the ``o`` projection: (B, T, C) -> (B, T, H * D).
        ``cache`` (a ``KVCache`` layer): this call's keys and values join the cached ones, and the
        queries attend over all of them (``positions`` then say where the new tokens sit)."""
        if x.dim() != 3:
            raise ValueError(f"Attention.apply: x must be (B, T, C), got shape {tuple(x.shape)}.")
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.kv_heads, self.dim
        layers = self._layers()
        q = layers["q"].apply(params["q"], x).view(B, T, H, D)  # (B, T, H, D)
        k = layers["k"].apply(params["k"], x).view(B, T, Hkv, D)  # (B, T, Hkv, D)
        v = layers["v"].apply(params["v"], x).view(B, T, Hkv, D)
        if self.rope:
            if positions is None:  # this rank's global positions when the sequence is split
                positions = torch.arange(T) if self.seq is None else self.seq.positions(T, x.device)
            pos = positions.to(x.device)
            cos, sin = rope_cos_sin(pos, D, theta=self.rope_theta, dtype=q.dtype)  # (..., T, D)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # decoding: (B, L + T, Hkv, D) keys and values, (B, L + T) key mask
            if self.seq is not None:
                raise ValueError("Attention: a KV cache with the sequence split over a mesh axis; decode with "
                                 "the unsplit (or tensor-parallel) model.")
            attend = getattr(cache, "attend", None)
            if attend is not None:  # a cache that attends itself (cfx.serve's paged one: a kernel over its blocks)
                return attend(q, k, v).reshape(B, T, H * D)
            k, v, mask = cache.update(k, v, mask)  # a (B, T, S) mask holds the causal rule too
        causal = self.causal and (cache is None or mask is None)
        if self.seq is not None:  # the other ranks' positions: ring / ulysses
            out = self.seq.attend(q, k, v, causal=causal, mask=mask, impl=self.impl)  # (B, T, H, D)
        else:
            out = attention(q, k, v, causal=causal, mask=mask, impl=self.impl)  # (B, T, H, D)
        return out.reshape(B, T, H * D)

    def axes(self) -> dict:
        return {n: layer.axes() for n, layer in self._layers().items()}
