"""cfx_kernels.fused_softmax: the Triton kernels (interpreted on CPU) against the reference over
broadcast patterns of the bias and mask, gradients included; the reference against textbook
math; and the input errors."""
from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

from cfx_kernels import fused_softmax as fs
from cfx_kernels.fused_softmax_reference import fused_softmax_reference
from cfx_tests.budget import examples
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("interpret")

BIASES = ("none", "full", "pair", "pair_t", "row")
MASKS = ("none", "keys", "queries", "full")


def make_inputs(B, S, H, R, L, *, bias, mask, dtype=torch.float32, seed=0):
    """Evoformer-shaped logits x (B, S, H, R, L), a bias and a mask of the named patterns, dy.

    bias: "full" (B, S, H, R, L); "pair" (B, 1, H, R, L), shared by the S rows; "pair_t" the same
    as a permuted (non-contiguous) view of a (B, R, L, H) tensor, as a linear layer on the pair
    representation gives it; "row" (1, 1, 1, 1, L). mask: "keys" (B, 1, 1, 1, L), "queries"
    (B, S, 1, R, 1), "full" (B, S, H, R, L); each has fully masked rows (the whole last batch
    entry for "keys" when B > 1).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, R, L, generator=g) * 3
    b = {"none": None,
         "full": lambda: torch.randn(B, S, H, R, L, generator=g),
         "pair": lambda: torch.randn(B, 1, H, R, L, generator=g),
         "pair_t": lambda: torch.randn(B, R, L, H, generator=g).permute(0, 3, 1, 2).unsqueeze(1),
         "row": lambda: torch.randn(1, 1, 1, 1, L, generator=g)}[bias]
    b = None if b is None else (b() * 2).to(dtype)
    shape = {"none": None, "keys": (B, 1, 1, 1, L), "queries": (B, S, 1, R, 1),
             "full": (B, S, H, R, L)}[mask]
    m = None
    if shape is not None:
        m = torch.rand(*shape, generator=g) > 0.3
        if mask == "keys" and B > 1:
            m[-1] = False
        elif mask != "keys":
            m[0, 0, 0, 0] = False
    dy = torch.randn(B, S, H, R, L, generator=g)
    return x.to(dtype), b, m, dy.to(dtype)


def run(impl, x, bias, mask, dy):
    """Output and grads (x[, bias]) on fresh leaves."""
    x = x.clone().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    y = fs.fused_softmax(x, bias, mask, impl=impl)
    leaves = (x,) if bias is None else (x, bias)
    return (y.detach(),) + torch.autograd.grad(y, leaves, dy)


def check_kernel(x, bias, mask, dy, dtype):
    got, want = run("triton", x, bias, mask, dy), run("reference", x, bias, mask, dy)
    for name, g, r in zip(["y", "dx", "dbias"], got, want):
        assert_close(g, r, dtype, name)


shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2), "S": st.integers(1, 3), "H": st.integers(1, 2), "R": st.integers(1, 6),
    "L": st.integers(1, 40), "bias": st.sampled_from(BIASES), "mask": st.sampled_from(MASKS),
    "seed": st.integers(0, 2**16)})


# ------------------------------------------------------------- kernel (interpreted) vs reference


@examples(ci=10)
@given(p=shapes)
def test_kernel_matches_reference_fp32(p):
    x, bias, mask, dy = make_inputs(*(p[k] for k in "BSHRL"), bias=p["bias"], mask=p["mask"],
                                    seed=p["seed"])
    check_kernel(x, bias, mask, dy, torch.float32)


@examples(ci=6)
@given(p=shapes, dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_kernel_matches_reference_half(p, dtype):
    x, bias, mask, dy = make_inputs(*(p[k] for k in "BSHRL"), bias=p["bias"], mask=p["mask"],
                                    dtype=dtype, seed=p["seed"])
    check_kernel(x, bias, mask, dy, dtype)


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("mask", MASKS)
def test_kernel_every_broadcast_pattern(bias, mask):
    x, b, m, dy = make_inputs(2, 3, 2, 5, 7, bias=bias, mask=mask, seed=len(bias) + 7 * len(mask))
    check_kernel(x, b, m, dy, torch.float32)


@pytest.mark.parametrize("L", [1500, 3000])
def test_kernel_long_rows_over_several_programs(L):
    # 2 rows a program (L = 1500), or 1 (L = 3000); the last program gets a partial block
    x, dy = randn(5, L, seed=0) * 3, randn(5, L, seed=1)
    bias, mask = randn(L, seed=2), randn(5, L, seed=3) > -1
    assert fs._grid(x.shape)[1]["ROWS"] == 4096 // triton.next_power_of_2(L)
    check_kernel(x, bias, mask, dy, torch.float32)


def test_kernel_mixed_dtypes_and_strided_x():
    # bf16 logits with an fp32 bias: y and dx in bf16, dbias in fp32; x a transposed view
    x, bias, mask, dy = make_inputs(1, 2, 2, 6, 6, bias="pair", mask="keys", seed=3)
    x = x.transpose(-1, -2).to(torch.bfloat16)
    got = run("triton", x, bias, mask, dy.to(torch.bfloat16))
    want = run("reference", x, bias, mask, dy.to(torch.bfloat16))
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, g, r in zip(["y", "dx", "dbias"], got, want):
        assert_close(g, r, torch.bfloat16, name)


@pytest.mark.parametrize("x_shape, bias_shape, mask_shape, leading", [
    ((9,), (9,), None, []),
    ((4, 9), (9,), (4, 1), [4]),
    ((2, 1, 3, 2, 2, 3, 9), (2, 1, 3, 1, 1, 1, 9), (1, 1, 1, 2, 2, 3, 9), [6, 12]),
    ((2, 2, 2, 2, 2, 2, 5), (1, 2, 1, 2, 1, 2, 5), None, [2] * 6),  # nothing merges
])
def test_kernel_any_rank(x_shape, bias_shape, mask_shape, leading):
    x, dy, bias = randn(*x_shape, seed=0), randn(*x_shape, seed=1), randn(*bias_shape, seed=2)
    mask = None if mask_shape is None else randn(*mask_shape, seed=3) > -0.5
    assert fs._row_layout(x.shape, bias, mask)[0] == leading  # the dims the kernel splits rows over
    if len(leading) <= fs.MAX_LEADING_DIMS:
        check_kernel(x, bias, mask, dy, torch.float32)
        return
    with pytest.raises(ValueError, match="6 leading dims"):
        fs.fused_softmax(x, bias, mask, impl="triton")
    # auto (CPU) runs the reference
    assert torch.equal(fs.fused_softmax(x, bias, mask), fused_softmax_reference(x, bias, mask))


# ------------------------------------------------------------- semantics, both implementations


def test_reference_matches_textbook_math():
    for bias, mask in [("pair", "keys"), ("full", "full"), ("row", "queries"), ("none", "none")]:
        x, b, m, _ = make_inputs(2, 3, 2, 5, 6, bias=bias, mask=mask, seed=1)
        z = x.double() if b is None else x.double() + b.double()
        want = torch.softmax(z if m is None else z.masked_fill(~m, -1e9), dim=-1)
        torch.testing.assert_close(fused_softmax_reference(x, b, m).double(), want,
                                   atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_masked_positions_get_no_gradient_and_empty_rows_are_uniform(impl):
    x, bias, mask, dy = make_inputs(2, 3, 2, 4, 6, bias="pair", mask="keys", seed=5)
    y, dx, dbias = run(impl, x, bias, mask, dy)
    masked = ~mask.expand_as(x)
    assert masked[-1].all() and not masked[0].all()  # batch entry 1: every row fully masked
    torch.testing.assert_close(y[-1], torch.full_like(y[-1], 1 / 6))  # as AlphaFold's 1e9 bias
    assert torch.equal(y[0][masked[0]], torch.zeros_like(y[0][masked[0]]))
    assert torch.equal(dx[masked], torch.zeros_like(dx[masked]))
    assert torch.equal(dbias[-1], torch.zeros_like(dbias[-1]))  # only fully masked rows feed it
    assert dx[~masked].abs().sum() > 0
    torch.testing.assert_close(y.sum(-1), torch.ones_like(y.sum(-1)))


# ------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", ["triton", "reference", "auto"])
def test_bad_input_names_the_argument(impl):
    x = randn(2, 3, 4, seed=0)
    cases = [
        ((torch.ones(2, 3, 4, dtype=torch.int64),), "x must be a floating-point tensor"),
        ((torch.tensor(1.0),), "x must be a floating-point tensor"),
        ((x, torch.ones(3, 4, dtype=torch.int32)), "bias must be a floating-point tensor"),
        ((x, randn(3, 3, seed=1)),
         r"bias of shape \(3, 3\) does not broadcast to x's shape \(2, 3, 4\)"),
        ((x, randn(1, 2, 3, 4, seed=1)), r"bias of shape \(1, 2, 3, 4\) does not broadcast"),
        ((x, None, randn(2, 1, 4, seed=1) > 0.0), None),  # fine
        ((x, None, torch.ones(2, 1, 4)), "mask must be a bool tensor.*mask.bool()"),
        ((x, None, torch.ones(2, 1, 5, dtype=torch.bool)), r"mask of shape \(2, 1, 5\) does not"),
        ((x, torch.zeros(4, device="meta")), "bias is on meta but x is on cpu"),
        ((x, None, torch.ones(4, dtype=torch.bool, device="meta")),
         "mask is on meta but x is on cpu"),
    ]
    for args, match in cases:
        if match is None:
            fs.fused_softmax(*args, impl=impl)
            continue
        with pytest.raises(ValueError, match=match):
            fs.fused_softmax(*args, impl=impl)


def test_triton_only_limits_suggest_the_reference():
    x = randn(2, 8, seed=0)
    with pytest.raises(ValueError, match=r"x has dtype torch.float64.*impl='reference'"):
        fs.fused_softmax(x.double(), impl="triton")
    with pytest.raises(ValueError, match=r"bias has dtype torch.float64.*impl='reference'"):
        fs.fused_softmax(x, randn(8, seed=1).double(), impl="triton")
    long = torch.zeros(1, fs.MAX_LENGTH + 1)
    with pytest.raises(ValueError, match=f"last dim is {fs.MAX_LENGTH + 1}.*impl='reference'"):
        fs.fused_softmax(long, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        fs.fused_softmax(x, impl="cuda")
    # the reference takes them (fp64 stays fp64)
    y = fs.fused_softmax(x.double(), impl="reference")
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, torch.softmax(x.double(), -1))
    torch.testing.assert_close(fs.fused_softmax(long), torch.full_like(long, 1 / long.shape[-1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_at_real_size(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, bias, mask, dy = make_inputs(1, 64, 8, 256, 256, bias="pair_t", mask="keys", dtype=dtype)
    x, bias, mask, dy = (t.cuda() for t in (x, bias, mask, dy))
    got, want = run("triton", x, bias, mask, dy), run("reference", x, bias, mask, dy)
    for name, g, r in zip(["y", "dx", "dbias"], got, want):
        assert_close(g, r, dtype, name)
