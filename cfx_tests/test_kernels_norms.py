"""cfx_kernels.norms: the Triton kernels (interpreted on CPU) against the reference, the
reference against textbook math, and the wiring into cfx.nn.LayerNorm / RMSNorm."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cfx
from cfx import nn
from cfx_kernels import norms
from cfx_kernels.norms_reference import layer_norm_reference, rms_norm_reference
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("interpret")


def run(kind, impl, x, w, b, dy, eps):
    """Output and grads (x, w[, b]) of one norm on fresh leaves."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if kind == "rms":
        y = norms.rms_norm(x, w, eps=eps, impl=impl)
        args = (x, w)
    else:
        b = None if b is None else b.clone().requires_grad_()
        y = norms.layer_norm(x, w, b, eps=eps, impl=impl)
        args = (x, w) if b is None else (x, w, b)
    return (y.detach(),) + torch.autograd.grad(y, args, dy.to(y.dtype))


@settings(max_examples=12)
@given(kind=st.sampled_from(["layer", "rms"]), dtype=st.sampled_from(DTYPES),
       lead=st.sampled_from([(1,), (7,), (2, 3)]), N=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(kind, dtype, lead, N, bias, seed):
    x = (randn(*lead, N, seed=seed) * 2 + 0.5).to(dtype)
    w = randn(N, seed=seed + 1) + 1.0
    b = randn(N, seed=seed + 2) if bias else None
    dy = randn(*lead, N, seed=seed + 3)
    got = run(kind, "triton", x, w, b, dy, 1e-5)
    want = run(kind, "reference", x, w, b, dy, 1e-5)
    for name, g, r in zip(["y", "dx", "dweight", "dbias"], got, want):
        assert_close(g, r, dtype, name)


def run_add(kind, impl, x, r, w, b, ds, dy, eps):
    """Both outputs and the grads (x, residual, w[, b]) of one fused add + norm; ``ds`` / ``dy`` None:
    that output is not used."""
    x, r, w = (t.clone().requires_grad_() for t in (x, r, w))
    if kind == "rms":
        s, y = norms.add_rms_norm(x, r, w, eps=eps, impl=impl)
        args = (x, r, w)
    else:
        b = None if b is None else b.clone().requires_grad_()
        s, y = norms.add_layer_norm(x, r, w, b, eps=eps, impl=impl)
        args = (x, r, w) if b is None else (x, r, w, b)
    outs, grads = zip(*[(o, g.to(o.dtype)) for o, g in ((s, ds), (y, dy)) if g is not None])
    return (s.detach(), y.detach()) + torch.autograd.grad(outs, args, grads, allow_unused=True)


@settings(max_examples=12)
@given(kind=st.sampled_from(["layer", "rms"]), dtype=st.sampled_from(DTYPES),
       lead=st.sampled_from([(1,), (7,), (2, 3)]), N=st.integers(1, 300), bias=st.booleans(),
       used=st.sampled_from(["both", "sum", "norm"]), seed=st.integers(0, 2**16))
def test_fused_add_norm_matches_reference(kind, dtype, lead, N, bias, used, seed):
    x = (randn(*lead, N, seed=seed) * 2 + 0.5).to(dtype)
    r = randn(*lead, N, seed=seed + 4).to(dtype)
    w = randn(N, seed=seed + 1) + 1.0
    b = randn(N, seed=seed + 2) if bias else None
    ds = None if used == "norm" else randn(*lead, N, seed=seed + 5)
    dy = None if used == "sum" else randn(*lead, N, seed=seed + 3)
    got = run_add(kind, "triton", x, r, w, b, ds, dy, 1e-5)
    want = run_add(kind, "reference", x, r, w, b, ds, dy, 1e-5)
    for name, g, ref in zip(["s", "y", "dx", "dresidual", "dweight", "dbias"], got, want):
        if ref is None:
            assert g is None or not g.any(), name
        else:
            assert_close(g, ref, dtype, name)
    torch.testing.assert_close(want[0], x + r)  # the reference: the add, then the norm of its result


def test_fused_add_norm_refuses_a_mismatched_residual():
    x = randn(2, 8, seed=0)
    with pytest.raises(ValueError, match="residual must have x's shape and dtype"):
        norms.add_layer_norm(x, x[:, :4], torch.ones(8))
    with pytest.raises(ValueError, match="residual must have x's shape and dtype"):
        norms.add_rms_norm(x, x.double(), torch.ones(8))


def test_references_match_textbook_math():
    x, w, b = randn(5, 33, seed=0, dtype=torch.float64), randn(33, seed=1), randn(33, seed=2)
    x32 = x.float()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()
    torch.testing.assert_close(layer_norm_reference(x32, w, b, 1e-5).double(), want,
                               atol=1e-5, rtol=1e-5)
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(rms_norm_reference(x32, w, 1e-6).double(), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_keeps_hf_rounding_and_dtype():
    # the normalised x is rounded to bf16 before the fp32 scale: the result is fp32 (as in HF)
    x, w = randn(4, 64, seed=0, dtype=torch.bfloat16), randn(64, seed=1)
    for impl in ("triton", "reference"):
        y = norms.rms_norm(x, w, eps=1e-6, impl=impl)
        assert y.dtype == torch.float32
        x32 = x.float()
        want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layer", [nn.LayerNorm(48), nn.LayerNorm(48, bias=False), nn.RMSNorm(48)])
def test_nn_layers_use_the_kernel(layer):
    params = cfx.tree.map(lambda p: p + 0.3 * randn(*p.shape, seed=p.numel()), layer.init(None))
    x = randn(2, 5, 48, seed=7)

    def loss(p, x, impl):
        return dataclasses.replace(layer, impl=impl).apply(p, x).pow(2).sum()

    got = cfx.grad(loss, argnums=(0, 1))(params, x, "triton")
    want = cfx.grad(loss, argnums=(0, 1))(params, x, "reference")
    cfx.tree.assert_tree_close(got, want, atol=1e-4, rtol=1e-4)
    assert layer.impl == "auto"  # CPU default: the reference path (checked by test_nn's math)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_bad_input_names_the_argument(fn):
    f = getattr(norms, fn)
    x, w = randn(3, 8, seed=0), randn(8, seed=1)
    with pytest.raises(ValueError, match="weight"):
        f(x, randn(7, seed=1), impl="triton")
    with pytest.raises(ValueError, match="x must be a floating"):
        f(torch.ones(3, 8, dtype=torch.int64), w, impl="triton")
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        f(x.double(), w, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        f(x, w, impl="cuda")
    if fn == "layer_norm":
        with pytest.raises(ValueError, match="bias"):
            f(x, w, torch.zeros(3), impl="triton")
    assert torch.equal(f(x.double(), w.double(), impl="reference"), f(x.double(), w.double()))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_at_real_size(kind, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    M, N = 8192, 4096
    x = randn(M, N, seed=0, dtype=dtype, device="cuda")
    w, b = randn(N, seed=1, device="cuda") + 1, randn(N, seed=2, device="cuda")
    dy = randn(M, N, seed=3, device="cuda")
    got = run(kind, "triton", x, w, b, dy, 1e-5)
    want = run(kind, "reference", x, w, b, dy, 1e-5)
    for name, g, r in zip(["y", "dx", "dweight", "dbias"], got, want):
        assert_close(g, r, dtype, name)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_the_block_fuses_its_residual_add_with_the_next_norm(norm):
    # a pre-norm block's attention residual and norm2 through add_apply: the kernel equals the reference
    block = nn.TransformerBlock(32, 4, 64, norm=norm)
    params = cfx.tree.map(lambda p: p + 0.1 * randn(*p.shape, seed=p.numel()), block.init(cfx.random.key(0)))
    x = randn(2, 6, 32, seed=3)

    def loss(p, x, impl):
        layers = {n: dataclasses.replace(b, impl=impl) if n.startswith("norm") else b
                  for n, b in block._layers().items()}
        object.__setattr__(block, "_sublayers", layers)
        return block.apply(p, x).pow(2).sum()

    got = cfx.value_and_grad(loss, argnums=(0, 1))(params, x, "triton")
    want = cfx.value_and_grad(loss, argnums=(0, 1))(params, x, "reference")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fused_add_norm_on_gpu_at_real_size(kind, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    M, N, dtype = 8192, 4096, torch.bfloat16
    x, r = randn(M, N, seed=0, dtype=dtype, device="cuda"), randn(M, N, seed=4, dtype=dtype, device="cuda")
    w, b = randn(N, seed=1, device="cuda") + 1, randn(N, seed=2, device="cuda")
    ds, dy = randn(M, N, seed=5, device="cuda"), randn(M, N, seed=3, device="cuda")
    got = run_add(kind, "triton", x, r, w, b, ds, dy, 1e-5)
    want = run_add(kind, "reference", x, r, w, b, ds, dy, 1e-5)
    for name, g, ref in zip(["s", "y", "dx", "dresidual", "dweight", "dbias"], got, want):
        if ref is not None:
            assert_close(g, ref, dtype, name)
