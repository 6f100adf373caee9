"""cfx.optim schedules against their formulas (Python floats), at drawn steps and at boundaries."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cfx import optim

values = st.floats(-10.0, 10.0)
positive = st.floats(1e-4, 10.0)


def check(schedule, step, expected):
    """The schedule at a Python int (-> float) and at a 0-d int32 tensor (-> 0-d float32 tensor)."""
    out = schedule(step)
    assert isinstance(out, float)
    torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)
    out_t = schedule(torch.tensor(step, dtype=torch.int32))
    assert isinstance(out_t, torch.Tensor) and out_t.shape == () and out_t.dtype == torch.float32
    torch.testing.assert_close(out_t, torch.tensor(expected, dtype=torch.float32))


def linear_ref(step, init, end, steps, begin):
    frac = min(max(step - begin, 0), steps) / steps
    return init + (end - init) * frac


def cosine_ref(step, init, decay_steps, alpha, exponent):
    t = min(step, decay_steps) / decay_steps
    return init * ((1 - alpha) * (0.5 * (1 + math.cos(math.pi * t))) ** exponent + alpha)


def warmup_cosine_ref(step, init, peak, warmup, decay, end, exponent):
    if step < warmup:
        return init + (peak - init) * step / warmup
    if decay == warmup:
        return end
    t = min(step - warmup, decay - warmup) / (decay - warmup)
    return end + (peak - end) * (0.5 * (1 + math.cos(math.pi * t))) ** exponent


def boundary_steps(*marks):
    return sorted({max(s, 0) for m in marks for s in (m - 1, m, m + 1)} | {0, 2 * max(marks) + 5})


@given(values, values, st.integers(1, 50), st.integers(0, 20), st.integers(0, 100))
def test_linear_schedule(init, end, steps, begin, step):
    s = optim.linear_schedule(init, end, steps, transition_begin=begin)
    for k in boundary_steps(begin, begin + steps) + [step]:
        check(s, k, linear_ref(k, init, end, steps, begin))


@given(values, st.integers(1, 50), st.floats(0.0, 1.0), st.floats(0.5, 3.0), st.integers(0, 100))
def test_cosine_decay_schedule(init, decay_steps, alpha, exponent, step):
    s = optim.cosine_decay_schedule(init, decay_steps, alpha=alpha, exponent=exponent)
    for k in boundary_steps(decay_steps, decay_steps // 2) + [step]:
        check(s, k, cosine_ref(k, init, decay_steps, alpha, exponent))


@given(st.floats(0.0, 1.0), positive, st.integers(0, 30), st.integers(0, 50), st.floats(0.0, 1.0),
       st.floats(0.5, 3.0), st.integers(0, 100))
def test_warmup_cosine_decay_schedule(init, peak, warmup, cos_steps, end_frac, exponent, step):
    decay, end = warmup + cos_steps, end_frac * peak
    s = optim.warmup_cosine_decay_schedule(init, peak, warmup, decay, end_value=end, exponent=exponent)
    for k in boundary_steps(warmup, decay) + [step]:
        check(s, k, warmup_cosine_ref(k, init, peak, warmup, decay, end, exponent))
    check(s, 0, init if warmup else (peak if cos_steps else end))


@given(values, st.integers(0, 100))
def test_constant_schedule(value, step):
    s = optim.constant_schedule(value)
    assert s(step) == value and s(torch.tensor(step)) == value


@given(st.integers(1, 20), st.integers(1, 20), st.integers(0, 60))
def test_join_schedules(warmup, hold, step):
    s = optim.join_schedules([optim.linear_schedule(0.0, 1.0, warmup), optim.constant_schedule(1.0),
                              optim.cosine_decay_schedule(1.0, 10)], [warmup, warmup + hold])
    if step < warmup:
        expected = step / warmup
    elif step < warmup + hold:
        expected = 1.0
    else:
        expected = cosine_ref(step - warmup - hold, 1.0, 10, 0.0, 1.0)
    check(s, step, expected)


def test_schedule_keeps_the_step_device_and_needs_no_sync():
    s = optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100)
    step = torch.tensor(5, dtype=torch.int32)
    assert s(step).device == step.device
    torch.testing.assert_close(s(step), torch.tensor(0.5))


@pytest.mark.parametrize("make, match", [
    (lambda: optim.linear_schedule(0.0, 1.0, 0), "transition_steps=0 must be an integer > 0"),
    (lambda: optim.linear_schedule(0.0, 1.0, 10, transition_begin=-1), "transition_begin"),
    (lambda: optim.linear_schedule(0.0, float("nan"), 10), "end_value"),
    (lambda: optim.cosine_decay_schedule(1.0, 0), "decay_steps"),
    (lambda: optim.cosine_decay_schedule(1.0, 10, alpha=1.5), "alpha"),
    (lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "includes the warmup"),
    (lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, 2.5, 5), "warmup_steps"),
    (lambda: optim.join_schedules([optim.constant_schedule(1.0)], [3]), "one boundary fewer"),
    (lambda: optim.join_schedules([optim.constant_schedule(1.0)] * 3, [5, 3]), "sorted"),
])
def test_bad_schedule_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()
