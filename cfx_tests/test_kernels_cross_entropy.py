"""cfx_kernels.cross_entropy: the Triton kernels (interpreted on CPU) against the reference and
F.cross_entropy, the vocab-parallel pieces combined by hand over 2-4 shards, and bad input."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cfx_kernels import cross_entropy as ce
from cfx_kernels.cross_entropy_reference import cross_entropy_reference
from cfx_tests.kernel_helpers import assert_close, interpret, randn  # noqa: F401 (fixture)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("interpret")


def targets_for(shape, V, seed, ignore_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t[torch.rand(shape, generator=g) < ignore_frac] = -100
    return t


def loss_and_grad(impl, logits, targets, **kw):
    z = logits.clone().requires_grad_()
    loss = ce.cross_entropy(z, targets, impl=impl, **kw)
    weight = randn(*loss.shape, seed=5) if loss.dim() else torch.tensor(1.0)
    (grad,) = torch.autograd.grad(loss, z, weight)
    return loss.detach(), grad


@settings(max_examples=12)
@given(dtype=st.sampled_from(DTYPES), lead=st.sampled_from([(1,), (5,), (2, 3)]),
       V=st.one_of(st.integers(1, 40), st.integers(1000, 2600)),
       smoothing=st.sampled_from([0.0, 0.1]), reduction=st.sampled_from(["mean", "sum", "none"]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(dtype, lead, V, smoothing, reduction, seed):
    logits = (randn(*lead, V, seed=seed) * 4).to(dtype)
    targets = targets_for(lead, V, seed + 1)
    targets.view(-1)[0] = V - 1  # at least one valid row, and the last column as a target
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    got_loss, got_grad = loss_and_grad("triton", logits, targets, **kw)
    want_loss, want_grad = loss_and_grad("reference", logits, targets, **kw)
    assert_close(got_loss, want_loss, torch.float32, "loss")  # the loss is fp32 either way
    assert_close(got_grad, want_grad, dtype, "dlogits")


def test_reference_is_exact_against_naive_math():
    z, t = randn(6, 50, seed=0, dtype=torch.float64), targets_for((6,), 50, 1)
    t[0] = 3
    logp = z - torch.log(torch.exp(z).sum(-1, keepdim=True))
    valid = t != -100
    nll = -logp[valid].gather(-1, t[valid, None]).squeeze(-1)
    smooth = -logp[valid].mean(-1)
    for eps in (0.0, 0.2):
        want = ((1 - eps) * nll + eps * smooth).mean()
        got = cross_entropy_reference(z.float(), t, ignore_index=-100, label_smoothing=eps,
                                      reduction="mean")
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_all_ignored_is_nan_like_pytorch(impl):
    z, t = randn(3, 10, seed=0), torch.full((3,), -100)
    assert torch.isnan(ce.cross_entropy(z, t, impl=impl))
    assert torch.isnan(F.cross_entropy(z, t))


def test_int32_targets_work_on_both_paths():
    z, t = randn(4, 30, seed=0), targets_for((4,), 30, 1)
    t[0] = 29
    want = F.cross_entropy(z, t)
    for impl in ("triton", "reference"):
        torch.testing.assert_close(ce.cross_entropy(z, t.int(), impl=impl), want)


@settings(max_examples=8)
@given(n_shards=st.integers(2, 4), V=st.integers(8, 300), smoothing=st.sampled_from([0.0, 0.1]),
       impl=st.sampled_from(["triton", "reference"]), data=st.data())
def test_vocab_parallel_pieces_combine_to_cross_entropy(n_shards, V, smoothing, impl, data):
    cuts = sorted(data.draw(st.lists(st.integers(1, V - 1), min_size=n_shards - 1,
                                     max_size=n_shards - 1, unique=True), label="cuts"))
    bounds = [0, *cuts, V]
    z = randn(7, V, seed=V) * 3
    t = targets_for((7,), V, V + 1)
    t[0] = V - 1
    shards = [(lo, z[:, lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    stats = [ce.cross_entropy_stats(s, t, vocab_start=lo, impl=impl) for lo, s in shards]
    # the combine a vocab-parallel caller does with pmax / psum (see the module docstring)
    M = torch.stack([s.max for s in stats]).amax(0)
    lse = M + torch.log(sum(s.sum_exp * torch.exp(s.max - M) for s in stats))
    z_t = sum(s.target_logit for s in stats)
    sz = sum(s.sum_logits for s in stats)
    rows = ce.loss_from_stats(lse, z_t, sz, t, vocab_size=V, label_smoothing=smoothing)

    zz = z.clone().requires_grad_()
    want = F.cross_entropy(zz, t, label_smoothing=smoothing, reduction="none")
    torch.testing.assert_close(rows, want.detach(), atol=1e-5, rtol=1e-5)
    # gradient of the mean loss, shard by shard
    n_valid = (t != -100).sum()
    (want_grad,) = torch.autograd.grad(want.sum() / n_valid, zz)
    grad_rows = (t != -100).float() / n_valid
    got_grad = torch.cat([ce.cross_entropy_shard_grad(s, t, lse, grad_rows, vocab_start=lo,
                                                      vocab_size=V, label_smoothing=smoothing,
                                                      impl=impl) for lo, s in shards], dim=-1)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)


def test_bad_input_names_the_argument():
    z, t = randn(4, 10, seed=0), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="targets shape"):
        ce.cross_entropy(z, torch.zeros(5, dtype=torch.int64), impl="triton")
    with pytest.raises(ValueError, match="targets must be an integer"):
        ce.cross_entropy(z, t.float(), impl="triton")
    with pytest.raises(ValueError, match="logits must be a floating"):
        ce.cross_entropy(t, t, impl="triton")
    with pytest.raises(ValueError, match="logits have dtype torch.float64"):
        ce.cross_entropy(z.double(), t, impl="triton")
    with pytest.raises(ValueError, match="label_smoothing"):
        ce.cross_entropy(z, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        ce.cross_entropy(z, t, reduction="avg")
    with pytest.raises(ValueError, match="lse must have targets' shape"):
        ce.cross_entropy_shard_grad(z, t, torch.zeros(3), torch.zeros(4), vocab_start=0,
                                    vocab_size=10, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_at_real_size(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    N, V = 8192, 50257
    logits = (randn(N, V, seed=0, device="cuda") * 4).to(dtype)
    targets = targets_for((N,), V, 1).cuda()
    for smoothing in (0.0, 0.1):
        got = loss_and_grad("triton", logits, targets, label_smoothing=smoothing)
        want = loss_and_grad("reference", logits, targets, label_smoothing=smoothing)
        assert_close(got[0], want[0], torch.float32, "loss")
        assert_close(got[1], want[1], dtype, "dlogits")


@pytest.mark.gpu
def test_kernel_needs_less_memory_than_pytorch_on_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    N, V = 8192, 50257
    logits = randn(N, V, seed=0, device="cuda").bfloat16().requires_grad_()
    targets = targets_for((N,), V, 1).cuda()
    peaks = {}
    for impl in ("triton", "reference"):
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ce.cross_entropy(logits, targets, impl=impl).backward()
        torch.cuda.synchronize()
        peaks[impl] = torch.cuda.max_memory_allocated() - base
    # the reference holds fp32 logits and log-probabilities (2 x 4 bytes per logit) at its peak
    assert peaks["triton"] < 0.5 * peaks["reference"], peaks
