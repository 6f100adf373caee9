"""cfx_kernels.linear_cross_entropy: the chunked, fused loss against the unfused
``F.cross_entropy(hidden @ weight.T + bias, targets)`` in the loss and in all three gradients (fp64
tightly; fp32 / fp16 / bf16 at the kernels' tolerances, each chunk's loss through the reference
and through the Triton kernels, interpreted on CPU), bf16 against fp32, that no tensor the size
of the ``(N, V)`` logits is ever made and the peak bytes stay a chunk's, the no-grad path, the
default chunk size, and bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cfx
from cfx_kernels import linear_cross_entropy as lce
from cfx_kernels.linear_cross_entropy_reference import linear_cross_entropy_reference
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
pytestmark = pytest.mark.usefixtures("interpret")


def unfused(hidden, weight, targets, bias=None, **kw):
    """What one writes without the fused loss: the whole logits of an nn.Linear head (one addmm,
    so bf16 logits are rounded once, as the fused loss rounds them), upcast, then F.cross_entropy."""
    logits = F.linear(hidden, weight, bias)  # (..., V)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1).long(), **kw)
    return loss.view(targets.shape) if kw.get("reduction") == "none" else loss


def problem(lead, C, V, seed, *, bias=True, dtype=torch.float32, ignore_frac=0.25):
    """hidden (*lead, C), weight (V, C), bias (V,) or None, targets (*lead,) with ignored rows;
    logits of order 1-3, as an LM head's are."""
    h = randn(*lead, C, seed=seed, dtype=dtype)
    w = (randn(V, C, seed=seed + 1) * 2 / math.sqrt(C)).to(dtype)
    b = (randn(V, seed=seed + 2) * 0.1).to(dtype) if bias else None
    g = torch.Generator().manual_seed(seed + 3)
    t = torch.randint(0, V, lead, generator=g)
    t[torch.rand(lead, generator=g) < ignore_frac] = -100
    t.view(-1)[0] = V - 1  # at least one valid row, and the last class as a target
    return h, w, b, t


def loss_and_grads(f, h, w, b, t, **kw):
    """The loss and d(loss . weights)/d(hidden, weight[, bias]) on fresh leaves."""
    leaves = [x.clone().requires_grad_() for x in (h, w, b) if x is not None]
    loss = f(leaves[0], leaves[1], t, bias=leaves[2] if b is not None else None, **kw)
    weights = (randn(loss.numel(), seed=7).view(loss.shape) + 1.5).to(loss.dtype)
    return (loss.detach(),) + torch.autograd.grad(loss, leaves, weights)


def fused(**opts):
    return lambda h, w, t, *, bias, **kw: lce.linear_cross_entropy(h, w, t, bias=bias, **opts, **kw)


@given(N=st.integers(1, 40), C=st.integers(1, 12), V=st.integers(1, 50),
       chunk=st.one_of(st.none(), st.integers(1, 45)), two_dims=st.booleans(), bias=st.booleans(),
       reduction=st.sampled_from(REDUCTIONS), smoothing=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 2**16))
def test_fp64_equals_unfused(N, C, V, chunk, two_dims, bias, reduction, smoothing, seed):
    lead = (2, N) if two_dims else (N,)
    h, w, b, t = problem(lead, C, V, seed, bias=bias, dtype=torch.float64)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    got = loss_and_grads(fused(chunk_size=chunk, impl="reference"), h, w, b, t, **kw)
    want = loss_and_grads(unfused, h, w, b, t, **kw)
    for name, g, r in zip(["loss", "dhidden", "dweight", "dbias"], got, want):
        assert g.dtype == r.dtype == torch.float64, name
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-10, msg=name)


@given(dtype=st.sampled_from(DTYPES), impl=st.sampled_from(["triton", "reference"]),
       N=st.integers(1, 24), C=st.integers(1, 32), V=st.one_of(st.integers(1, 40), st.integers(1000, 1100)),
       chunk=st.one_of(st.none(), st.integers(1, 9)), bias=st.booleans(),
       reduction=st.sampled_from(REDUCTIONS), smoothing=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 2**16))
def test_matches_unfused_in_each_dtype(dtype, impl, N, C, V, chunk, bias, reduction, smoothing, seed):
    h, w, b, t = problem((N,), C, V, seed, bias=bias, dtype=dtype)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    got = loss_and_grads(fused(chunk_size=chunk, impl=impl), h, w, b, t, **kw)
    want = loss_and_grads(unfused, h, w, b, t, **kw)
    # the loss is fp32 for every input dtype, but of logits rounded to the inputs' dtype by matmuls
    # over different row blocks: it agrees to the inputs' precision
    for name, g, r in zip(["loss", "dhidden", "dweight", "dbias"], got, want):
        assert_close(g, r, dtype, name)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_is_within_its_rounding_of_fp32(impl, reduction):
    # bf16 keeps 8 bits: the loss (an fp32 sum of bf16 logits' rounding errors) lands within 2e-3
    # relative; the gradients (each a bf16 matmul of bf16 dlogits) within 3e-2 of their largest
    # entry, as the unfused bf16 loss's own gradients do (measured: 2e-2 at worst over 30 seeds)
    h, w, b, t = problem((64,), 32, 1000, seed=3)
    got = loss_and_grads(fused(chunk_size=24, impl=impl), h.bfloat16(), w.bfloat16(), b.bfloat16(), t,
                         reduction=reduction)
    want = loss_and_grads(unfused, h, w, b, t, reduction=reduction)
    torch.testing.assert_close(got[0], want[0], atol=0.0, rtol=2e-3)
    for name, g, r in zip(["dhidden", "dweight", "dbias"], got[1:], want[1:]):
        assert g.dtype == torch.bfloat16, name
        err = (g.double() - r.double()).abs().max().item()
        assert err <= 3e-2 * max(1.0, r.abs().max().item()), (name, err)


def test_reference_is_the_loss_of_the_plain_expression():
    h, w, b, t = problem((10,), 6, 30, seed=0, dtype=torch.float64)
    for reduction in REDUCTIONS:
        got = linear_cross_entropy_reference(h, w, t, bias=b, reduction=reduction, label_smoothing=0.1)
        want = F.cross_entropy(h @ w.T + b, t, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_all_ignored_is_nan_with_zero_gradients_like_pytorch(impl):
    h, w, b, t = problem((3,), 4, 10, seed=0)
    t[:] = -100
    got = loss_and_grads(fused(impl=impl), h, w, b, t)
    want = loss_and_grads(unfused, h, w, b, t)
    assert torch.isnan(got[0]) and torch.isnan(want[0])
    for g, r in zip(got[1:], want[1:]):
        assert torch.equal(g, r) and not g.any()


def test_int32_targets_and_a_custom_ignore_index():
    h, w, b, t = problem((9,), 5, 20, seed=1)
    t[t == -100] = 7
    t[1] = 3
    want = unfused(h, w, t, b, ignore_index=7)
    for impl in ("triton", "reference"):
        got = lce.linear_cross_entropy(h, w, t.int(), bias=b, ignore_index=7, chunk_size=4, impl=impl)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_autocast_the_matmuls_run_in_its_dtype_like_f_linear(reduction):
    h, w, b, t = problem((12,), 8, 40, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(fused(chunk_size=5, impl="reference"), h, w, b, t, reduction=reduction)
        want = loss_and_grads(unfused, h, w, b, t, reduction=reduction)
    for name, g, r in zip(["loss", "dhidden", "dweight", "dbias"], got, want):
        assert g.dtype == torch.float32, name  # fp32 leaves get fp32 gradients
        assert_close(g, r, torch.bfloat16, name)


# ------------------------------------------------------------------------- what is allocated

class LargestOutput(TorchDispatchMode):
    """Records the most bytes of any tensor an op returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel() * x.element_size())
        return out


def fwd_bwd(f, h, w, b, t, **kw):
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    loss = f(*leaves[:2], t, bias=leaves[2], **kw)
    loss.backward(torch.ones_like(loss))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_tensor_of_the_logits_size_is_made(impl, reduction):
    N, C, V, chunk = 96, 4, 50, 16
    h, w, b, t = problem((N,), C, V, seed=0)
    with LargestOutput() as seen:
        fwd_bwd(unfused, h, w, b, t, reduction=reduction)
    assert seen.largest >= 4 * N * V  # the detector sees the unfused fp32 logits
    with LargestOutput() as seen:
        fwd_bwd(fused(chunk_size=chunk, impl=impl), h, w, b, t, reduction=reduction)
    # fp32: a chunk's logits, the hidden states, the weight
    assert seen.largest <= 4 * max(chunk * V, N * C, V * C) < 4 * N * V


def test_peak_bytes_are_the_gradients_and_a_few_chunks():
    # op outputs booked by cfx.memory while they live: the fused loss holds its gradients (saved
    # by the forward, then scaled by the backward: twice) and a few fp32 chunk-sized temporaries
    # (logits, exp, dlogits: measured under 3); the logits of all rows at once (N V 4 bytes)
    # would break the bound
    N, C, V, chunk = 512, 16, 512, 32
    h, w, b, t = problem((N,), C, V, seed=0)
    grads = 4 * (N * C + V * C + V)
    bound = 2 * grads + 4 * chunk * V * 4 + 4 * 4 * N  # + a few (N,) per-row vectors
    assert bound < N * V * 4
    peaks = {}
    for name, f in (("fused", fused(chunk_size=chunk, impl="reference")), ("unfused", unfused)):
        with cfx.memory.track() as mem, mem.track_ops():
            fwd_bwd(f, h, w, b, t)
        peaks[name] = mem.peak("device")
    assert peaks["fused"] <= bound, peaks
    assert peaks["unfused"] >= 2 * N * V * 4, peaks  # logits and their softmax, fp32


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out,
                               torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_work_only_for_inputs_that_need_it(reduction):
    N, chunk = 20, 6  # 4 chunks: one logits matmul each, and one per gradient of h and of w
    h, w, b, t = problem((N,), 5, 30, seed=0)
    want = unfused(h, w, t, b, reduction=reduction)

    def count(grad_of, no_grad=False):
        leaves = {k: x.clone().requires_grad_(k in grad_of) for k, x in dict(h=h, w=w, b=b).items()}
        with MatmulCount() as mm, torch.set_grad_enabled(not no_grad):
            loss = lce.linear_cross_entropy(leaves["h"], leaves["w"], t, bias=leaves["b"],
                                            chunk_size=chunk, reduction=reduction, impl="reference")
            if grad_of and not no_grad:
                loss.backward(torch.ones_like(loss))
        torch.testing.assert_close(loss.detach(), want)
        return mm.count

    walk_again = 4 if reduction == "none" else 0  # none's backward recomputes the logits
    assert count({"h", "w", "b"}, no_grad=True) == 4
    assert count(set()) == 4
    assert count({"b"}) == 4 + walk_again
    assert count({"h"}) == 4 + 4 + walk_again
    assert count({"h", "w", "b"}) == 4 + 8 + walk_again


def test_default_chunk_size(monkeypatch):
    assert lce.default_chunk_size(50257) == 1280 and lce.default_chunk_size(128256) == 512
    assert lce.default_chunk_size(2**30) == 1 and lce.default_chunk_size(1) == lce.CHUNK_BYTES // 4
    assert all(lce.default_chunk_size(V) * V * 4 <= lce.CHUNK_BYTES for V in (1, 7, 1000, 50257, 10**6))
    monkeypatch.setattr(lce, "CHUNK_BYTES", 40 * 4 * 10)  # 40 rows at V = 10
    h, w, b, t = problem((100,), 3, 10, seed=0)
    with MatmulCount() as mm:
        loss = lce.linear_cross_entropy(h, w, t, bias=b, impl="reference")
    assert mm.count == 3  # rows 0-39, 40-79, 80-99
    torch.testing.assert_close(loss, unfused(h, w, t, b))


def test_bad_input_names_the_argument():
    h, w, b, t = problem((4,), 6, 10, seed=0)
    call = lce.linear_cross_entropy
    cases = [
        (dict(weight=w.T), r"weight must be \(V, C\).*not its transpose"),
        (dict(bias=b[:3]), r"bias must be \(V,\) = \(10,\)"),
        (dict(hidden=h.double()), "must share one dtype.*hidden torch.float64, weight torch.float32"),
        (dict(targets=t.float()), "targets must be an integer"),
        (dict(targets=t[:3]), r"targets shape \(3,\) must equal"),
        (dict(hidden=h.long()), "hidden must be a floating-point"),
        (dict(targets=torch.tensor([0, 1, 10, -100])), r"class ids in \[0, V\) = \[0, 10\).*got 10"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(label_smoothing=1.5), "label_smoothing must lie in"),
        (dict(chunk_size=0), "chunk_size must be a positive"),
        (dict(hidden=h.double(), weight=w.double(), bias=b.double(), impl="triton"),
         "the Triton kernels take"),
        (dict(impl="cuda"), "impl must be one of"),
    ]
    for change, match in cases:
        args = {**dict(hidden=h, weight=w, targets=t, bias=b), **change}
        with pytest.raises(ValueError, match=match):
            call(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


# ----------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_gpu_at_real_size(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w, b, t = (x.cuda() for x in problem((4096,), 1024, 50257, seed=0, dtype=dtype))
    got = loss_and_grads(fused(impl="triton"), h, w, b, t)
    want = loss_and_grads(unfused, h, w, b, t)
    assert_close(got[0], want[0], torch.float32, "loss")
    for name, g, r in zip(["dhidden", "dweight", "dbias"], got[1:], want[1:]):
        assert_close(g, r, dtype, name)


@pytest.mark.gpu
def test_peak_memory_on_gpu_is_below_unfused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    N, C, V = 8192, 2048, 50257
    h, w, _, t = problem((N,), C, V, seed=0, bias=False)
    h, w, t = h.cuda().bfloat16(), w.cuda().bfloat16(), t.cuda()
    peaks = {}
    for name, f in (("fused", fused(impl="triton")), ("unfused", unfused)):
        leaves = [x.clone().requires_grad_() for x in (h, w)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f(*leaves, t, bias=None).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    # unfused holds the bf16 logits and fp32 copies of them (>= 6 N V bytes = 2.4 GB); fused
    # holds the gradients, dW's fp32 accumulator (4 V C) and one chunk
    assert peaks["fused"] < 0.5 * peaks["unfused"], peaks
