"""Attention kernels: the reference path against naive PyTorch on CPU, the Triton flash-attention
kernel against ``F.scaled_dot_product_attention`` (flash backend) on CUDA, and ``auto_vs_best``: what
``cfx.nn.attention(impl="auto")`` runs (``cfx_kernels.attention_choice``'s table) against the faster of
the Triton kernel and SDPA with torch's own backend choice; the row names the faster, which is what
the table for that GPU family should say.

CPU: median forward+backward time of ``attention_reference`` (what CPU users get from
``cfx_kernels.flash_attention``) over naive ``softmax(q k^T) v`` with repeated kv heads, as a ratio
(same inputs, interleaved rounds). CUDA (when present): TFLOP/s of forward+backward, causal,
bf16, for sequence lengths 512..16K at 16K tokens per batch, counting the usual
``3.5 * 4 * B * H * T * S * D / 2`` FLOPs (backward = 2.5 x forward, causal halves both).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from cfx._src.nn.attention import attention
from cfx.bench.common import Row, interleaved_medians
from cfx_kernels.attention_reference import attention_reference
from cfx_kernels.flash_attention import flash_attention


def _naive(q, k, v):
    """Causal softmax(q k^T / sqrt(D)) v with kv heads repeated: what one writes by hand."""
    T, H, D = q.shape[1], q.shape[2], q.shape[3]
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    v = v.repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * D ** -0.5  # (B, H, T, S)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v)  # (B, T, H, D)


def _fwd_bwd(fn, *inputs, sync=lambda: None):
    do = torch.randn_like(fn(*inputs))

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(do)
        sync()

    return step


def cpu_rows(size: str) -> list[Row]:
    B, T, H, Hkv, D = {"smoke": (1, 32, 4, 2, 16), "quick": (1, 256, 8, 2, 64), "full": (2, 1024, 8, 2, 64)}[size]
    rounds, warmup = {"smoke": (1, 0), "quick": (15, 2), "full": (10, 2)}[size]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, T, Hkv, D, generator=g, requires_grad=True)
    ref = _fwd_bwd(lambda q, k, v: attention_reference(q, k, v, causal=True), q, k, v)
    naive = _fwd_bwd(_naive, q, k, v)
    t_ref, t_naive = interleaved_medians([ref, naive], rounds=rounds, warmup=warmup)
    shape = f"B={B} T=S={T} H={H} Hkv={Hkv} D={D} fp32 causal"
    return [
        Row(f"attention reference fwd+bwd ({shape})", t_ref * 1e3, "ms"),
        Row(f"attention naive fwd+bwd ({shape})", t_naive * 1e3, "ms"),
        Row("attention reference / naive time (CPU)", t_ref / t_naive, "ratio", "<= 1.1",
            ok=t_ref / t_naive <= 1.1),
    ]


def cuda_rows(size: str, seqs: tuple[int, ...] | None = None, head_dims: tuple[int, ...] = (64,)) -> list[Row]:
    """``seqs`` and ``head_dims`` override the size's cases (``gpu --all``: T 512 / 2048 / 8192, D 64 / 128;
    1024 model width, so 16 heads of 64 or 8 of 128)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(T, D) for D in head_dims
             for T in seqs or {"smoke": (512,), "quick": (512, 2048), "full": (512, 1024, 2048, 4096, 8192, 16384)}[size]]
    rounds = {"smoke": 1, "quick": 5, "full": 20}[size]
    rows = []
    for T, D in cases:
        H, tokens = 1024 // D, 16384
        B = max(1, tokens // T)
        flops = 3.5 * 4 * B * H * T * T * D / 2
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                        requires_grad=True)
        q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)  # (B, T, H, D)
        qs, ks, vs = mk(B, H, T, D), mk(B, H, T, D), mk(B, H, T, D)  # SDPA's (B, H, T, D)

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        ours = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, impl="triton"), q, k, v,
                        sync=torch.cuda.synchronize)
        theirs = _fwd_bwd(sdpa, qs, ks, vs, sync=torch.cuda.synchronize)
        # cfx.nn.attention as the models call it: auto's pick, and SDPA with torch's own backend choice
        auto, any_sdpa = (_fwd_bwd(lambda q, k, v, i=i: attention(q, k, v, causal=True, impl=i), q, k, v,
                                   sync=torch.cuda.synchronize) for i in ("auto", "sdpa"))
        t_ours, t_theirs, t_auto, t_sdpa = interleaved_medians([ours, theirs, auto, any_sdpa], rounds=rounds,
                                                               warmup=2)
        best = min(t_ours, t_sdpa)
        rows += [Row(f"flash attention fwd+bwd T={T} D={D} (B={B} H={H} bf16 causal)",
                     flops / t_ours / 1e12, "TFLOP/s"),
                 Row(f"SDPA flash fwd+bwd T={T} D={D}", flops / t_theirs / 1e12, "TFLOP/s"),
                 Row(f"SDPA (torch's backend choice) fwd+bwd T={T} D={D}", flops / t_sdpa / 1e12, "TFLOP/s"),
                 Row(f"attention_vs_sdpa_fwd_bwd T={T} D={D} (Triton / SDPA flash throughput)", t_theirs / t_ours,
                     "x", ">= 1.00", t_theirs / t_ours >= 1.0),
                 Row(f"attention_vs_sdpa_any_fwd_bwd T={T} D={D} (Triton / SDPA, torch's backend choice)",
                     t_sdpa / t_ours, "x"),
                 Row(f"auto_vs_best T={T} D={D} (auto's pick / the faster of Triton and SDPA; faster: "
                     f"{'triton' if t_ours < t_sdpa else 'sdpa'})", best / t_auto, "x", ">= 0.98",
                     best / t_auto >= 0.98)]
    return rows


# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates around the H200's fastest of the first sweep
# (dk/dv 64 x 64 x 4 warps x 3 stages; dq 64 x 64 x 4 x 3 at D 64, 128 x 64 x 8 x 3 at D 128)
DKDV_TILES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3),
              (128, 32, 8, 3), (32, 32, 4, 3)]
DQ_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 4, 3), (128, 32, 4, 3),
            (128, 128, 8, 3), (64, 32, 8, 3)]


def tile_sweep_rows(T: int = 4096, head_dims: tuple[int, ...] = (64, 128), deadline: float = float("inf")) -> list[Row]:
    """The backward's time per tile (BLOCK_M, BLOCK_N, num_warps, num_stages), bf16 causal, 16K tokens
    of a 1024-wide layer: each kernel's candidates timed with the other kernel at its current tile, so
    the differences are that kernel's (``triton.testing.do_bench``, ms). What ``_blocks`` should say on
    this GPU; a tile that does not compile (shared memory) is left out."""
    from types import SimpleNamespace

    import triton.testing

    from cfx_kernels import flash_attention as fa

    rows = []
    for D in head_dims:
        H, B = 1024 // D, max(1, 16384 // T)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = D ** -0.5
        o, lse = fa._forward(q, k, v, None, True, scale)
        now = fa._blocks(D, torch.bfloat16, q.device)
        for kernel, tiles in (("dkdv", DKDV_TILES), ("dq", DQ_TILES)):
            best = (float("inf"), None)
            for tile in tiles:
                if time.perf_counter() > deadline:
                    rows.append(Row(f"  tile sweep D={D} {kernel}: out of time", 0.0, "skipped"))
                    break
                blocks = SimpleNamespace(dkdv=tile if kernel == "dkdv" else now.dkdv, dq=tile if kernel == "dq" else now.dq)
                try:
                    ms = triton.testing.do_bench(lambda: fa._backward(q, k, v, None, o, lse, do, True, scale, blocks),
                                                 warmup=5, rep=25)
                except Exception as e:  # noqa: BLE001 -- out of shared memory or registers: not a candidate
                    rows.append(Row(f"  tile sweep D={D} T={T} {kernel} {tile}", 0.0, f"skipped: {type(e).__name__}"))
                    continue
                best = min(best, (ms, tile))
                mark = " (current)" if tile == getattr(now, kernel) else ""
                rows.append(Row(f"  tile sweep D={D} T={T} {kernel} {tile}{mark}: backward", ms, "ms"))
            if best[1] is not None:
                rows.append(Row(f"tile sweep D={D} T={T} {kernel}: fastest tile {best[1]}", best[0], "ms"))
    return rows


def rows(size: str) -> list[Row]:
    out = cpu_rows(size)
    if torch.cuda.is_available():
        out += cuda_rows(size)
    return out
