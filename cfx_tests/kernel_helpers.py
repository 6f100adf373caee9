"""What the kernel tests share: the interpreter switch, tolerances and seeded inputs."""
import pytest
import torch

# fp32 within 1e-4, fp16/bf16 within 1e-2, of the largest magnitude in the expected tensor
# (at least 1): bf16 keeps 8 bits, so two correct roundings of a value near 4 already differ by
# 0.016, and a weight gradient summed over many rows is as large as the sum.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def interpret():
    """Run Triton kernels on CPU tensors through the interpreter for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:  # read at launch: see cfx_kernels/_jit.py
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str = "") -> None:
    """``|got - want| <= tol(dtype) * max(1, max|want|)`` elementwise, with matching shape and dtype."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all() == torch.isfinite(w).all(), f"{name}: non-finite values differ"
    bound = TOLERANCE[dtype] * max(1.0, w.abs().max().item() if w.numel() else 0.0)
    err = (g - w).abs().max().item() if g.numel() else 0.0
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g} ({dtype})"


def randn(*shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
