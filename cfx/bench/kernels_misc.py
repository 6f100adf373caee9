"""Norms, cross-entropy, flat AdamW and int8 matmul: what ``python -m cfx.bench kernels`` shows
for the kernels other than attention.

On CPU, each kernel's reference path (what ``impl="auto"`` runs there) against the naive PyTorch
a user would write, as a speed ratio (naive time / reference time; > 1 means the reference is
faster). Several references are those naive ops themselves, so about 1 is the expected value
and the CPU rows carry no target. On CUDA, additionally: GB/s of the fused norms (forward +
backward) and of the flat AdamW step against the same math under ``torch.compile``, and the
peak memory of the cross-entropy kernel against ``F.cross_entropy`` on fp32-upcast logits.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from cfx.bench.common import Row, interleaved_medians
from cfx_kernels import adamw, cross_entropy, int8_matmul, norms
from cfx_kernels.adamw_reference import adamw_flat_reference_
from cfx_kernels.norms_reference import layer_norm_reference, rms_norm_reference


def _randn(*shape, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _fwd_bwd(f: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``f`` (one output, or a tuple: each gets a gradient of ones)."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    dy = None

    def step():
        nonlocal dy
        y = f(*leaves)
        y = y if isinstance(y, tuple) else (y,)
        dy = [torch.ones_like(t) for t in y] if dy is None else dy
        torch.autograd.grad(y, [x for x in leaves if x.requires_grad], dy)
    return step


# ----------------------------------------------------------------------- naive PyTorch baselines

def _naive_layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _naive_rms_norm(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def _naive_cross_entropy(z, t):
    return -torch.log_softmax(z.float(), -1).gather(-1, t[:, None]).mean()


def _naive_int8(x, q, scale, b):
    return x @ (q.float() * scale) + b  # dequantise the whole weight, then matmul


CPU_SIZES = {  # size -> (rounds, norms' (M, C), cross-entropy's (N, V), AdamW's n, int8's (rows, in, out))
    "smoke": (1, (64, 64), (16, 512), 2**10, (4, 64, 128)),
    "quick": (9, (1024, 768), (256, 50257), 2**20, (64, 768, 3072)),
    "full": (25, (8192, 768), (1024, 50257), 2**24, (512, 768, 3072)),
}


def _cpu_rows(size: str) -> list[Row]:
    rounds, (M, C), (N, V), n, (rows_i, k_i, n_i) = CPU_SIZES[size]
    x, w, b = _randn(M, C), _randn(C, seed=1), _randn(C, seed=2)
    z, t = _randn(N, V, seed=3), torch.randint(0, V, (N,))
    q, scale = int8_matmul.quantize_weight(_randn(k_i, n_i, seed=4))
    xi, bi = _randn(rows_i, k_i, seed=5), _randn(n_i, seed=6)

    p, g, m, v = _randn(n), _randn(n, seed=7), torch.zeros(n), torch.zeros(n)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, foreach=False)
    state = {"step": 0}

    def flat_step():
        state["step"] += 1
        adamw.adamw_flat_(p, g, m, v, step=state["step"], lr=1e-4, weight_decay=0.1,
                          impl="reference")

    cases = [
        ("layer_norm fwd+bwd", _fwd_bwd(lambda x, w, b: norms.layer_norm(x, w, b, impl="reference"),
                                        x, w, b), _fwd_bwd(_naive_layer_norm, x, w, b)),
        ("rms_norm fwd+bwd", _fwd_bwd(lambda x, w: norms.rms_norm(x, w, impl="reference"), x, w),
         _fwd_bwd(_naive_rms_norm, x, w)),
        ("cross_entropy fwd+bwd", _fwd_bwd(
            lambda z, t: cross_entropy.cross_entropy(z, t, impl="reference"), z, t),
         _fwd_bwd(_naive_cross_entropy, z, t)),
        ("adamw_flat_ vs torch.optim.AdamW", flat_step, opt.step),
        ("int8_matmul vs dequantise+matmul", _fwd_bwd(
            lambda x, b: int8_matmul.int8_matmul(x, q, scale, b, impl="reference"), xi, bi),
         _fwd_bwd(lambda x, b: _naive_int8(x, q, scale, b), xi, bi)),
    ]
    rows = []
    for name, ref, naive in cases:
        t_ref, t_naive = interleaved_medians([ref, naive], rounds=rounds)
        rows.append(Row(f"cpu {name}: naive / reference time", t_naive / t_ref, "x"))
    return rows


# ----------------------------------------------------------------------------------- CUDA

def _gbps(nbytes: int, fn: Callable[[], None]) -> float:
    import triton.testing
    ms = triton.testing.do_bench(fn)
    return nbytes / (ms * 1e-3) / 1e9


CUDA_SIZES = {  # size -> (norms' (M, C), AdamW's n, cross-entropy's (N, V)); smoke: quick's, seconds on a GPU
    "smoke": ((4096, 4096), 2**26, (4096, 50257)),
    "quick": ((4096, 4096), 2**26, (4096, 50257)),
    "full": ((16384, 4096), 2**28, (16384, 50257)),
}


def cuda_rows(size: str) -> list[Row]:
    rows = []
    (M, C), n, (N, V) = CUDA_SIZES[size]
    x = _randn(M, C, device="cuda", dtype=torch.bfloat16)
    w, b = _randn(C, device="cuda", seed=1), _randn(C, device="cuda", seed=2)
    nbytes = 5 * M * C * x.element_size()  # fwd: read x, write y; bwd: read x, dy, write dx
    r = _randn(M, C, device="cuda", dtype=torch.bfloat16, seed=4)
    for name, kern, ref, args, nb in (
        ("layer_norm", lambda x, w, b: norms.layer_norm(x, w, b, impl="triton"),
         lambda x, w, b: layer_norm_reference(x, w, b, 1e-5), (x, w, b), nbytes),
        ("rms_norm", lambda x, w: norms.rms_norm(x, w, impl="triton").to(x.dtype),
         lambda x, w: rms_norm_reference(x, w, 1e-6).to(x.dtype), (x, w), nbytes),
        # + read r, write s; bwd: + read ds, write dresidual (= dx: one write serves both)
        ("add_layer_norm", lambda x, r, w, b: norms.add_layer_norm(x, r, w, b, impl="triton"),
         lambda x, r, w, b: (lambda s: (s, layer_norm_reference(s, w, b, 1e-5)))(x + r), (x, r, w, b), 8 * M * C * 2),
    ):
        k = _gbps(nb, _fwd_bwd(kern, *args))
        c = _gbps(nb, _fwd_bwd(torch.compile(ref), *args))
        rows += [Row(f"cuda {name} fwd+bwd bf16 {M}x{C} triton", k, "GB/s"),
                 Row(f"cuda {name} fwd+bwd torch.compile", c, "GB/s"),
                 Row(f"cuda {name} triton / torch.compile", k / c, "x", ">= 1", k / c >= 1.0)]

    p, g = _randn(n, device="cuda"), _randn(n, device="cuda", seed=3)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    hp = dict(step=10, lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    compiled = torch.compile(adamw_flat_reference_)
    k = _gbps(28 * n, lambda: adamw.adamw_flat_(p, g, m, v, impl="triton", **hp))
    c = _gbps(28 * n, lambda: compiled(p, g, m, v, **hp))
    rows += [Row(f"cuda adamw_flat_ fp32 n=2^{n.bit_length() - 1} triton", k, "GB/s"),
             Row("cuda adamw_flat_ torch.compile", c, "GB/s"),
             Row("cuda adamw_flat_ triton / torch.compile", k / c, "x", ">= 1", k / c >= 1.0)]

    logits = _randn(N, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    peaks = {}
    for impl, f in (("triton", lambda: cross_entropy.cross_entropy(logits, t, impl="triton")),
                    ("pytorch", lambda: F.cross_entropy(logits.float(), t))):
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f().backward()
        torch.cuda.synchronize()
        peaks[impl] = (torch.cuda.max_memory_allocated() - base) / 2**20
    rows += [Row(f"cuda cross_entropy fwd+bwd bf16 {N}x{V} peak, kernel", peaks["triton"], "MiB"),
             Row("cuda cross_entropy peak, F.cross_entropy(logits.float())", peaks["pytorch"], "MiB"),
             Row("cuda cross_entropy peak kernel / pytorch", peaks["triton"] / peaks["pytorch"], "x",
                 "<= 0.5", peaks["triton"] <= 0.5 * peaks["pytorch"])]
    return rows


def rows(size: str) -> list[Row]:
    """The table's rows: CPU always, CUDA when a GPU is present."""
    out = _cpu_rows(size)
    if torch.cuda.is_available():
        out += cuda_rows(size)
    return out
