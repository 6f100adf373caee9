"""Flash attention: the Triton kernel (interpreted on CPU, native on CUDA) against the reference,
and the reference against ``F.scaled_dot_product_attention`` and naive float64 math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import cfx
import cfx_kernels.attention_blocks as blocks_lib
import cfx_kernels.flash_attention as fa
from cfx_kernels.attention_reference import allowed_keys, attention_reference
from cfx_tests.budget import examples

MASKS = ("none", "pad", "rows", "add", "addpad")


@pytest.fixture(scope="module")
def interpret():
    """Run Triton kernels through the interpreter (module scope: hypothesis forbids function scope)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def make_inputs(B, T, S, H, Hkv, D, *, dtype=torch.float32, mask="none", seed=0, device="cpu"):
    """q (B, T, H, D), k/v (B, S, Hkv, D), a mask of the named kind, and an output cotangent.

    "pad" is a bool (B, S) key-padding mask whose last batch row is fully padded (its queries see
    nothing); "rows" a bool (B, T, S) mask; "add" / "addpad" a float (B, T, S) / (B, S) mask with
    some -inf entries.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, T, H, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    do = torch.randn(B, T, H, D, generator=g)
    m = None
    if mask == "pad":
        m = torch.rand(B, S, generator=g) > 0.3
        if B > 1:
            m[-1] = False
    elif mask == "rows":
        m = torch.rand(B, T, S, generator=g) > 0.4
    elif mask in ("add", "addpad"):
        shape = (B, T, S) if mask == "add" else (B, S)
        m = torch.randn(*shape, generator=g)
        m[torch.rand(*shape, generator=g) > 0.7] = float("-inf")
    cast = lambda t: t.to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return cast(q), cast(k), cast(v), None if m is None else m.to(device), do.to(device=device, dtype=dtype)


def out_and_grads(fn, q, k, v, do, **kw):
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def assert_all_close(got, want, tol, *, scaled=False):
    """Output and gradients within ``tol`` (atol and rtol). ``scaled`` (fp16/bf16): atol grows
    with the tensor's largest entry beyond 1, as a gradient summed over many rows can cancel to
    entries far smaller than the terms whose rounding it carries."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        atol = tol * max(1.0, b.abs().max().item()) if scaled else tol
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2),
    "Hkv": st.integers(1, 2),
    "group": st.integers(1, 2),
    "T": st.integers(1, 70),
    "S": st.integers(1, 70),
    "D": st.sampled_from([32, 64]),
    "causal": st.booleans(),
    "mask": st.sampled_from(MASKS),
    "seed": st.integers(0, 2**16),
})


def _run_kernel_vs_reference(p, dtype, tol):
    q, k, v, mask, do = make_inputs(p["B"], p["T"], p["S"], p["Hkv"] * p["group"], p["Hkv"], p["D"],
                                    dtype=dtype, mask=p["mask"], seed=p["seed"])
    kw = dict(causal=p["causal"], mask=mask)
    got = out_and_grads(fa.flash_attention, q, k, v, do, impl="triton", **kw)
    want = out_and_grads(attention_reference, q, k, v, do, **kw)
    assert all(g.dtype == dtype for g in got)
    assert_all_close(got, want, tol, scaled=dtype != torch.float32)


# ------------------------------------------------------------------ kernel (interpreted) vs reference


@examples(ci=8)
@given(p=shapes)
def test_kernel_matches_reference_fp32(interpret, p):
    _run_kernel_vs_reference(p, torch.float32, 1e-4)


@examples(ci=6)
@given(p=shapes, dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_kernel_matches_reference_half(interpret, p, dtype):
    _run_kernel_vs_reference(p, dtype, 1e-2)


@pytest.mark.parametrize("D", [48, 128])
def test_kernel_head_dims_padded_and_large(interpret, D):
    p = dict(B=1, Hkv=1, group=2, T=19, S=37, D=D, causal=True, mask="pad", seed=D)
    _run_kernel_vs_reference(p, torch.float32, 1e-4)


def test_kernel_rows_that_see_no_key_are_zero(interpret):
    # T > S with a bottom-right causal mask: the first T - S queries see no key; batch row 1 is
    # fully padded. Outputs there are 0 and every gradient is finite.
    q, k, v, mask, do = make_inputs(2, 40, 23, 2, 1, 32, mask="pad", seed=1)
    mask[0] = True
    got = out_and_grads(fa.flash_attention, q, k, v, do, causal=True, mask=mask, impl="triton")
    assert torch.equal(got[0][0, :17], torch.zeros_like(got[0][0, :17]))
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))
    assert all(torch.isfinite(g).all() for g in got)
    want = out_and_grads(attention_reference, q, k, v, do, causal=True, mask=mask)
    assert_all_close(got, want, 1e-4)


def test_cfx_nn_attention_impls_agree(interpret):
    q, k, v, mask, do = make_inputs(2, 21, 30, 4, 2, 32, mask="pad", seed=2)
    mask[-1, 0] = True  # SDPA itself cannot take a fully masked row; cfx.nn.attention can
    want = out_and_grads(cfx.nn.attention, q, k, v, do, mask=mask, impl="sdpa")
    for impl in ("triton", "reference"):
        assert_all_close(out_and_grads(cfx.nn.attention, q, k, v, do, mask=mask, impl=impl), want, 1e-4)
    assert torch.equal(cfx.nn.attention(q, k, v, mask=mask), want[0])  # CPU auto is SDPA


# ------------------------------------------------------------------ reference vs SDPA and naive math


def naive(q, k, v, *, causal, mask, scale=None):
    """softmax(q k^T * scale + bias) v with repeated kv heads; rows with no key give 0."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * (D ** -0.5 if scale is None else scale)
    bias = torch.zeros(B, 1, T, S, dtype=q.dtype)
    if causal:
        bias = bias.masked_fill(torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not(), float("-inf"))
    if mask is not None:
        m = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]
        bias = bias.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else bias + m
    s = s + bias
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, 0.0), dim=-1)
    return torch.einsum("bhts,bshd->bthd", torch.where(seen, p, 0.0), v)


@given(p=shapes, scale=st.sampled_from([None, 0.3]))
def test_reference_is_exact_against_naive_math(p, scale):
    q, k, v, mask, do = make_inputs(p["B"], p["T"], p["S"], p["Hkv"] * p["group"], p["Hkv"], p["D"],
                                    dtype=torch.float64, mask=p["mask"], seed=p["seed"])
    kw = dict(causal=p["causal"], mask=mask, scale=scale)
    assert_all_close(out_and_grads(attention_reference, q, k, v, do, **kw),
                     out_and_grads(naive, q, k, v, do, **kw), 1e-12)


@given(p=shapes)
def test_reference_matches_sdpa(p):
    B, T, S, Hkv, H = p["B"], p["T"], p["S"], p["Hkv"], p["Hkv"] * p["group"]
    mask = {"add": "rows", "addpad": "pad"}.get(p["mask"], p["mask"])
    q, k, v, m, do = make_inputs(B, T, S, H, Hkv, p["D"], mask=mask, seed=p["seed"])
    allowed = torch.ones(B, 1, T, S, dtype=torch.bool)
    if m is not None:
        allowed = allowed & (m[:, None, None, :] if m.dim() == 2 else m[:, None])
    if p["causal"]:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    seen = allowed.any(-1)  # (B, 1, T); SDPA gives NaN where False, so compare the rest
    allowed = allowed | ~seen[..., None]

    def sdpa(q, k, v):
        rep = lambda t: t.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # noqa: E731
        return F.scaled_dot_product_attention(q.transpose(1, 2), rep(k), rep(v),
                                              attn_mask=allowed).transpose(1, 2)

    keep = seen.transpose(1, 2)[..., None]  # (B, T, 1, 1)
    do = do * keep
    got = out_and_grads(attention_reference, q, k, v, do, causal=p["causal"], mask=m)
    want = out_and_grads(sdpa, q, k, v, do)
    torch.testing.assert_close(got[0] * keep, want[0] * keep)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ bad input


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a Triton kernel was launched")


@pytest.fixture
def no_launch(monkeypatch):
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        monkeypatch.setattr(fa, name, _NoLaunch())


@pytest.mark.parametrize("change, match", [
    (dict(D=256), "head_dim 256"),
    (dict(dtype=torch.float64), "dtype torch.float64"),
    (dict(dtype=torch.int32), "q must be a floating-point"),
    (dict(k_shape=(1, 9, 2, 32)), "k and v must have the same shape"),
    (dict(kv_batch=2), "batch sizes differ"),
    (dict(kv_heads=3), "not a multiple of k's 3 kv heads"),
    (dict(kv_dim=16), "head_dim differs"),
    (dict(q_dims=3), "q must be 4-D"),
    (dict(mask=torch.ones(1, 7, dtype=torch.bool)), r"mask must have shape \(B, S\)"),
    (dict(mask=torch.ones(1, 8, dtype=torch.int64)), "mask must be bool"),
    (dict(scale=float("nan")), "scale must be a finite float"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_bad_input_raises_value_error_before_any_launch(interpret, no_launch, change, match):
    D, dtype = change.get("D", 32), change.get("dtype", torch.float32)
    q = torch.ones(1, 5, 2, D).to(dtype)
    k = torch.ones(change.get("kv_batch", 1), 8, change.get("kv_heads", 1), change.get("kv_dim", D)).to(dtype)
    v = torch.ones(change["k_shape"]).to(dtype) if "k_shape" in change else k.clone()
    q = q[0] if change.get("q_dims") == 3 else q
    with pytest.raises(ValueError, match=match):
        fa.flash_attention(q, k, v, mask=change.get("mask"), scale=change.get("scale"),
                           impl=change.get("impl", "triton"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch, no_launch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.ones(1, 4, 1, 32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fa.flash_attention(q, q, q, impl="triton")
    assert torch.equal(fa.flash_attention(q, q, q), attention_reference(q, q, q))  # auto: reference


def test_additive_mask_gradient_is_refused():
    q = torch.ones(1, 4, 1, 32)
    with pytest.raises(ValueError, match="mask requires grad"):
        fa.flash_attention(q, q, q, mask=torch.zeros(1, 4, requires_grad=True))


# ------------------------------------------------------------------ compiled for a GPU, on any machine


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype, D, mask", [(torch.bfloat16, 64, "pad"), (torch.float16, 128, "none"),
                                            (torch.float32, 64, "add")])
def test_kernels_compile_for_gpus_without_one(monkeypatch, tmp_path, arch, dtype, D, mask):
    # The interpreter forgives what the compiler does not (dot shapes, dtypes, constexpr use):
    # build the real kernels ahead of time for sm80 / sm90 and check they fit in shared memory.
    # An empty cache makes it really compile, in a process that has run the interpreter before,
    # as a GPU test run does.
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ty = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    mask_ty = {"none": ty, "pad": "u8", "add": "fp32"}[mask]
    consts = dict(CAUSAL=mask != "add", MASK_KIND={"none": 0, "pad": 1, "add": 2}[mask],
                  MASK_ROWS=mask == "add", PRECISION=fa._precision(dtype), BLOCK_D=D)
    blocks = fa._blocks(D, dtype)
    for name, (BM, BN, warps, stages) in (("_fwd_kernel", blocks.fwd), ("_bwd_dkdv_kernel", blocks.dkdv),
                                          ("_bwd_dq_kernel", blocks.dq)):
        fn = triton.jit(getattr(fa, name).fn)
        sig = {}
        for arg in fn.arg_names:
            if arg in consts or arg in ("BLOCK_M", "BLOCK_N"):
                sig[arg] = "constexpr"
            elif arg in ("LSE", "DELTA"):
                sig[arg] = "*fp32"
            elif arg == "M":
                sig[arg] = "*" + mask_ty
            elif arg in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):
                sig[arg] = "*" + ty
            else:
                sig[arg] = "fp32" if arg.endswith("_scale") else "i32"
        src = ASTSource(fn, sig, dict(consts, BLOCK_M=BM, BLOCK_N=BN))
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))
        assert compiled.metadata.shared <= 160 * 1024, (name, compiled.metadata.shared)


# ------------------------------------------------------------------ GPU: the compiled kernel, real sizes


@pytest.fixture
def native(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal, mask", [(True, "none"), (False, "pad"), (True, "rows")])
def test_gpu_kernel_matches_reference(native, dtype, D, causal, mask):
    q, k, v, m, do = make_inputs(2, 1000, 1100, 8, 2, D, dtype=dtype, mask=mask, device="cuda")
    kw = dict(causal=causal, mask=m)
    got = out_and_grads(fa.flash_attention, q, k, v, do, impl="triton", **kw)
    want = out_and_grads(attention_reference, q, k, v, do, **kw)
    assert_all_close(got, want, 1e-4 if dtype == torch.float32 else 1e-2, scaled=True)


@pytest.mark.gpu
def test_gpu_memory_is_linear_in_sequence_length(native):
    T, H, D = 8192, 8, 64
    q, k, v, _, do = make_inputs(1, T, T, H, H, D, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out_and_grads(fa.flash_attention, q, k, v, do, impl="triton")
    extra = torch.cuda.max_memory_allocated() - base
    scores = H * T * T * 2  # one bf16 (T, S) score matrix per head: 1 GiB
    assert extra < scores / 8, f"peak extra memory {extra / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_gpu_cfx_nn_attention_auto_uses_the_kernel(native):
    q, k, v, _, _ = make_inputs(2, 300, 300, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
    auto = cfx.nn.attention(q, k, v)
    assert torch.equal(auto, fa.flash_attention(q, k, v, impl="triton"))


@pytest.mark.parametrize("causal,mask", [(False, "none"), (True, "none"), (False, "pad"), (True, "rows")])
def test_blocks_combine_to_the_whole_and_their_backward_sums_to_its_gradient(interpret, causal, mask):
    # split the keys in two blocks: (out, lse) of each combine by log-sum-exp into the whole
    # attention, and each block's backward from the whole's out and lse sums to its gradients --
    # the two facts ring attention rests on; for the Triton kernel and its reference alike
    q, k, v, m, do = make_inputs(2, 16, 24, 4, 2, 16, mask=mask, seed=3)
    want = out_and_grads(attention_reference, q, k, v, do, causal=causal, mask=m)
    allowed = allowed_keys(m, causal, 16, 24, q.device)  # (B|1, 1|T, S)
    allowed = allowed.expand(2, 16, 24) if allowed is not None else None
    cut = 10
    for impl in ("reference", "triton"):
        blocks = [(slice(0, cut)), slice(cut, 24)]
        part = lambda t, b: t[:, b].detach()  # noqa: E731
        outs = [blocks_lib.flash_attention_block(q.detach(), part(k, b), part(v, b), causal=False,
                                         mask=None if allowed is None else allowed[:, :, b], impl=impl) for b in blocks]
        lse = torch.logaddexp(outs[0][1], outs[1][1])
        out = sum(o.float() * torch.exp(l - lse).nan_to_num(0.0).transpose(1, 2)[..., None] for o, l in outs)
        torch.testing.assert_close(out, want[0].detach(), atol=1e-5, rtol=1e-5)
        grads = [blocks_lib.flash_attention_block_backward(q.detach(), part(k, b), part(v, b), want[0].detach(), lse, do,
                                                   causal=False, mask=None if allowed is None else allowed[:, :, b],
                                                   impl=impl) for b in blocks]
        torch.testing.assert_close(grads[0][0] + grads[1][0], want[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 1), want[2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 1), want[3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,mask", [(True, "none"), (False, "rows"), (True, "pad")])
def test_reference_blocks_take_a_tile_of_queries_at_a_time(monkeypatch, causal, mask):
    # scores for QUERY_TILE queries at a time (memory O(tile x S), as a flash kernel's): the same
    # (out, lse) and gradients as the whole block at once, causal offsets and per-query masks included
    import cfx_kernels.attention_reference as ref
    q, k, v, m, do = make_inputs(2, 16, 24, 4, 2, 16, mask=mask, seed=5)
    m = m if m is None or m.dtype == torch.bool else torch.isfinite(m)

    def both():
        out, lse = ref.attention_block_reference(q, k, v, causal=causal, mask=m)
        return (out, lse, *ref.attention_block_backward_reference(q, k, v, out, lse, do, causal=causal, mask=m))
    whole = both()
    monkeypatch.setattr(ref, "QUERY_TILE", 5)  # tiles of 5, 5, 5 and 1 queries
    for got, want in zip(both(), whole):
        torch.testing.assert_close(got, want)


def test_reference_block_scores_never_take_more_than_a_tile():
    # what makes ring attention's memory O(T/N) per rank on CPU: no (T, S) score matrix is held
    import cfx_kernels.attention_reference as ref
    q, k, v, _, do = make_inputs(1, 1024, 1024, 4, 4, 16, seed=1)
    q, k, v = q.detach(), k.detach(), v.detach()  # as ring attention's autograd.Function calls them
    with cfx.memory.track() as mem, mem.track_ops("device"):
        out, lse = ref.attention_block_reference(q, k, v, causal=True)
        ref.attention_block_backward_reference(q, k, v, out, lse, do, causal=True)
    scores = 4 * 1024 * 1024 * 4  # one (H, T, S) fp32 score matrix; whole, the backward holds 4 of them
    assert mem.peak("device") < scores / 2, (mem.peak("device"), scores)
