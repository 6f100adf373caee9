"""cfx_kernels.int8_matmul: the weight-only int8 matmul (Triton, interpreted on CPU) against the
reference, the reference against dequantise-then-matmul math, and the quantizer."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cfx_kernels.int8_matmul import int8_matmul, quantize_weight
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("interpret")


def out_and_grads(impl, x, q, scale, bias, dy):
    x = x.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    y = int8_matmul(x, q, scale, b, impl=impl)
    args = (x,) if b is None else (x, b)
    return (y.detach(),) + torch.autograd.grad(y, args, dy.to(y.dtype))


@settings(max_examples=12)
@given(dtype=st.sampled_from(DTYPES), lead=st.sampled_from([(1,), (17,), (2, 40)]),
       K=st.integers(1, 150), N=st.integers(1, 150), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(dtype, lead, K, N, bias, seed):
    q, scale = quantize_weight(randn(K, N, seed=seed))
    x = randn(*lead, K, seed=seed + 1).to(dtype)
    b = randn(N, seed=seed + 2) if bias else None
    dy = randn(*lead, N, seed=seed + 3)
    got = out_and_grads("triton", x, q, scale, b, dy)
    want = out_and_grads("reference", x, q, scale, b, dy)
    for name, g, w in zip(["y", "dx", "dbias"], got, want):
        assert_close(g, w, dtype, name)


def test_reference_is_exact_against_dequantised_math():
    w, x, b = randn(64, 48, seed=0), randn(5, 64, seed=1), randn(48, seed=2)
    q, scale = quantize_weight(w)
    want = x.double() @ (q.double() * scale.double()) + b.double()
    got = int8_matmul(x, q, scale, b, impl="reference")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def plain_autograd_reference(x, q, scale, bias):
    """The reference's ops recorded by autograd itself (what it ran before its own backward): the
    int8 weight's floating copy is what ``mm`` saves."""
    y = torch.mm(x.reshape(-1, q.shape[0]), q.to(x.dtype)).float() * scale
    y = y if bias is None else y + bias
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_backward_is_autograds_on_the_int8_weight(dtype, bias):
    """The reference's backward converts the int8 weight again: dx and dbias are the bits autograd
    gets from the saved floating copy, and what autograd saves is the int8 weight and its scale
    (K N + 4 N bytes), never a floating (K, N) tensor."""
    K, N = 96, 80
    q, scale = quantize_weight(randn(K, N, seed=0))
    x = randn(3, 7, K, seed=1).to(dtype)
    b = randn(N, seed=2) if bias else None
    dy = randn(3, 7, N, seed=3).to(dtype)
    got = out_and_grads("reference", x, q, scale, b, dy)
    xr = x.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    y = plain_autograd_reference(xr, q, scale, br)
    want = (y.detach(),) + torch.autograd.grad(y, (xr,) if br is None else (xr, br), dy)
    for name, g, w in zip(["y", "dx", "dbias"], got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel(), t.numel() * t.element_size()))
        return t
    for run in (int8_matmul, plain_autograd_reference):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kwargs = {"impl": "reference"} if run is int8_matmul else {}
            run(x.clone().requires_grad_(), q, scale, None if b is None else b.clone().requires_grad_(), **kwargs)
        weight_sized = [s for s in saved if s[0].is_floating_point and s[1] >= K * N]
        if run is int8_matmul:
            assert not weight_sized and sum(s[2] for s in saved) == K * N + 4 * N, saved
        else:  # the check can fail: autograd on the plain ops keeps the (K, N) copy in x's dtype
            assert weight_sized == [(dtype, K * N, K * N * x.element_size())], saved


def test_quantize_weight_is_symmetric_absmax_per_column():
    w = randn(100, 7, seed=0)
    w[:, 3] = 0.0  # an all-zero column
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (7,)
    assert q.abs().max() == 127 and q[:, 3].eq(0).all() and scale[3] == 1.0
    torch.testing.assert_close(scale[[0, 1, 2, 4, 5, 6]], w.abs().amax(0)[[0, 1, 2, 4, 5, 6]] / 127)
    err = (q.float() * scale - w).abs()
    assert (err <= scale / 2 + 1e-7).all()  # round to nearest: at most half a step per column


def test_bad_input_names_the_argument():
    q, scale = quantize_weight(randn(8, 4, seed=0))
    x = randn(3, 8, seed=1)
    with pytest.raises(ValueError, match="x has 7 features"):
        int8_matmul(x[:, :7], q, scale, impl="triton")
    with pytest.raises(ValueError, match="w_int8 must be a 2-D int8"):
        int8_matmul(x, q.float(), scale, impl="triton")
    with pytest.raises(ValueError, match="scale must be"):
        int8_matmul(x, q, scale[:3], impl="triton")
    with pytest.raises(ValueError, match="bias must be"):
        int8_matmul(x, q, scale, torch.zeros(5), impl="triton")
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        int8_matmul(x.double(), q, scale, impl="triton")
    with pytest.raises(ValueError, match="quantize_weight: w must be a 2-D"):
        quantize_weight(randn(8, seed=0))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_at_real_size(M, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    K, N = 4096, 11008
    q, scale = quantize_weight(randn(K, N, seed=0, device="cuda"))
    x = randn(M, K, seed=1, device="cuda", dtype=dtype)
    b = randn(N, seed=2, device="cuda")
    dy = randn(M, N, seed=3, device="cuda")
    got = out_and_grads("triton", x, q, scale, b, dy)
    want = out_and_grads("reference", x, q, scale, b, dy)
    for name, g, w in zip(["y", "dx", "dbias"], got, want):
        assert_close(g, w, dtype, name)
