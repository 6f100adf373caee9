"""cfx.random: known-answer Threefry vectors, determinism across threads and processes, independence."""
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx.random import threefry2x32

M = 0xFFFFFFFF


@pytest.mark.parametrize("key,ctr,expected", [  # Random123's known-answer tests for threefry2x32_20
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((M, M), (M, M), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_known_answers(key, ctr, expected):
    y0, y1 = threefry2x32(torch.tensor(key), torch.tensor(ctr[0]), torch.tensor(ctr[1]))
    assert (int(y0), int(y1)) == expected


def draw_all(k):
    return torch.cat([
        cfx.random.normal(k, (64,)), cfx.random.uniform(k, (8,)),
        cfx.random.truncated_normal(k, -1.0, 1.5, (8,)), cfx.random.bernoulli(k, 0.3, (8,)).float(),
        cfx.random.randint(k, (8,), 0, 100).float(), cfx.random.split(k, 3).flatten().float(),
        cfx.random.fold_in(k, 7).float(),
    ])


def test_same_key_same_numbers_across_threads():
    k = cfx.random.key(1234)
    expected = draw_all(k)
    results = [None] * 4

    def worker(i):
        results[i] = draw_all(k)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for r in results:
        assert torch.equal(r, expected)


def test_same_key_same_numbers_across_processes():
    k = cfx.random.key(99)
    code = ("import torch, cfx, sys; from cfx_tests.test_random import draw_all; "
            "torch.manual_seed(int(sys.argv[1])); print(draw_all(cfx.random.key(99)).tolist())")
    outs = [subprocess.run([sys.executable, "-c", code, str(s)], capture_output=True, text=True, check=True).stdout
            for s in (0, 1)]
    assert outs[0] == outs[1]
    assert torch.tensor(eval(outs[0])).allclose(draw_all(k))


def test_samplers_do_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    draw_all(cfx.random.key(5))
    assert torch.equal(before, torch.get_rng_state())


@given(seed=st.integers(0, 2**64 - 1), n=st.integers(2, 8), data=st.integers(0, 2**40))
def test_split_and_fold_in_give_distinct_independent_streams(seed, n, data):
    k = cfx.random.key(seed)
    children = cfx.random.split(k, n)
    keys = [tuple(c.tolist()) for c in children] + [tuple(k.tolist()), tuple(cfx.random.fold_in(k, data).tolist())]
    assert len(set(keys)) == len(keys)
    xs = torch.stack([cfx.random.normal(c, (4096,), dtype=torch.float64) for c in children])
    corr = torch.corrcoef(xs)
    off = corr - torch.eye(n, dtype=torch.float64)
    assert off.abs().max() < 0.1  # |r| ~ 1/sqrt(4096) = 0.016 for independent streams
    assert not torch.equal(cfx.random.normal(cfx.random.fold_in(k, data), (8,)),
                           cfx.random.normal(cfx.random.fold_in(k, data + 1), (8,)))


def test_sampler_statistics():
    k = cfx.random.key(0)
    x = cfx.random.normal(k, (200_000,), dtype=torch.float64)
    assert abs(x.mean()) < 0.01 and abs(x.std() - 1) < 0.01
    u = cfx.random.uniform(k, (200_000,), minval=-2.0, maxval=3.0)
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.02
    t = cfx.random.truncated_normal(k, -1.0, 2.0, (200_000,), dtype=torch.float64)
    assert t.min() > -1 and t.max() < 2
    # mean of N(0,1) truncated to (a, b): (phi(a) - phi(b)) / (Phi(b) - Phi(a))
    a, b = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    phi = lambda z: torch.exp(-z * z / 2) / (2 * torch.pi) ** 0.5
    expected = (phi(a) - phi(b)) / (torch.special.ndtr(b) - torch.special.ndtr(a))
    assert abs(t.mean() - expected) < 0.01
    assert abs(cfx.random.bernoulli(k, 0.3, (100_000,)).float().mean() - 0.3) < 0.01
    r = cfx.random.randint(k, (100_000,), 3, 7)
    assert set(r.unique().tolist()) == {3, 4, 5, 6}


def test_dtypes_devices_and_bad_input():
    k = cfx.random.key(3)
    assert cfx.random.normal(k, (4,), dtype=torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(cfx.random.normal(k, (4,), dtype=torch.bfloat16),
                               cfx.random.normal(k, (4,)).to(torch.bfloat16))
    with pytest.raises(ValueError, match="key"):
        cfx.random.normal(torch.zeros(3), (2,))
    with pytest.raises(ValueError, match="single key"):
        cfx.random.normal(cfx.random.split(k, 2), (2,))
    with pytest.raises(ValueError, match="seed"):
        cfx.random.key(1.5)


def test_categorical_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    draws = torch.stack([cfx.random.categorical(k, logits) for k in cfx.random.split(cfx.random.key(0), 4000)])
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=4).double() / len(draws)
        expected = torch.softmax(logits[row].double(), dim=0)
        assert (freq - expected).abs().max() < 0.03  # binomial sd <= 0.008 at n = 4000


def test_keys_under_eval_shape_have_shapes_without_running_the_cipher():
    # a shape-only trace (every model init under eval_shape) splits and folds keys by shape alone
    out = cfx.eval_shape(lambda k: (cfx.random.split(k, 5), cfx.random.fold_in(k, 3),
                                    cfx.random.normal(cfx.random.split(k)[1], (4, 3))), cfx.random.key(0))
    assert [tuple(x.shape) for x in out] == [(5, 2), (2,), (4, 3)]
    assert [x.dtype for x in out] == [torch.int64, torch.int64, torch.float32]


def test_samplers_follow_the_default_device_with_the_cpu_values():
    """``with torch.device("cuda"): model.init(key)`` (here ``meta``, the same dispatch): every sampler
    draws from the key's CPU generator, then lands on the default device; keys stay on the CPU."""
    k = cfx.random.key(0)
    draws = {
        "normal": lambda k: cfx.random.normal(k, (3,)),
        "uniform": lambda k: cfx.random.uniform(k, (3,)),
        "randint": lambda k: cfx.random.randint(k, (3,), 0, 9),
        "truncated_normal": lambda k: cfx.random.truncated_normal(k, shape=(3,)),
        "bernoulli": lambda k: cfx.random.bernoulli(k, 0.5, (3,)),
        "gumbel": lambda k: cfx.random.gumbel(k, (3,)),
        "permutation": lambda k: cfx.random.permutation(k, 5),
    }
    with torch.device("meta"):
        assert cfx.random.key(0).device.type == "cpu" and cfx.random.split(k).device.type == "cpu"
        for name, draw in draws.items():
            assert draw(k).device.type == "meta", name
        model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_embd=32, n_head=4, n_positions=16)
        assert {x.device.type for x in cfx.tree.leaves(model.init(k))} == {"meta"}
    for name, draw in draws.items():  # and outside it, the CPU as before
        assert draw(k).device.type == "cpu", name
