"""Learning-rate schedules: functions ``step -> value``.

``step`` is a 0-d integer tensor (the optimizer's count; the result is a 0-d float32 tensor on
the same device, computed without host syncs) or a Python int (the result is a Python float,
handy for plotting). Steps start at 0; the first update uses ``schedule(0)``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import torch

Schedule = Callable[[Any], Any]


def _check(fn: str, name: str, value: Any, *, lo: float | None = None, lo_open: bool = False,
           hi: float | None = None, integer: bool = False, hint: str = "") -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = isinstance(value, numbers.Integral)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        need = "an integer" if integer else "a finite number"
        bounds = []
        if lo is not None:
            bounds.append(f"{'>' if lo_open else '>='} {lo}")
        if hi is not None:
            bounds.append(f"<= {hi}")
        raise ValueError(f"cfx.optim.{fn}: {name}={value!r} must be {need}"
                         + (f" {' and '.join(bounds)}" if bounds else "")
                         + (f"; {hint}" if hint else "") + ".")


def _evaluate(step: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``f`` on ``step`` as a float32 tensor; back to a Python float if ``step`` was a number."""
    if isinstance(step, torch.Tensor):
        return f(step.to(torch.float32))
    return float(f(torch.tensor(float(step), dtype=torch.float32)))


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    _check("constant_schedule", "value", value)

    def schedule(step):
        del step
        return value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int, *,
                    transition_begin: int = 0) -> Schedule:
    """``init_value`` until ``transition_begin``, then linear to ``end_value`` over
    ``transition_steps`` steps, then ``end_value``. Linear warmup is
    ``linear_schedule(0.0, peak, warmup_steps)``."""
    _check("linear_schedule", "init_value", init_value)
    _check("linear_schedule", "end_value", end_value)
    _check("linear_schedule", "transition_steps", transition_steps, lo=0, lo_open=True, integer=True,
           hint="use constant_schedule for no transition")
    _check("linear_schedule", "transition_begin", transition_begin, lo=0, integer=True)

    def f(t):
        frac = (t - transition_begin).clamp(0.0, transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return lambda step: _evaluate(step, f)


def cosine_decay_schedule(init_value: float, decay_steps: int, *, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """``init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / decay_steps))) ** exponent + alpha)``
    with ``t = min(step, decay_steps)`` (Loshchilov & Hutter, 2017): ends at ``alpha * init_value``."""
    _check("cosine_decay_schedule", "init_value", init_value)
    _check("cosine_decay_schedule", "decay_steps", decay_steps, lo=0, lo_open=True, integer=True)
    _check("cosine_decay_schedule", "alpha", alpha, lo=0.0, hi=1.0,
           hint="alpha is the final value as a fraction of init_value")
    _check("cosine_decay_schedule", "exponent", exponent, lo=0.0, lo_open=True)

    def f(t):
        frac = t.clamp(0.0, decay_steps) / decay_steps
        cosine = (0.5 * (1.0 + torch.cos(math.pi * frac))) ** exponent
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return lambda step: _evaluate(step, f)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, *, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine decay
    to ``end_value`` at step ``decay_steps`` (which counts the warmup, as in optax), then constant.
    ``decay_steps == warmup_steps`` gives ``end_value`` right after the warmup."""
    fn = "warmup_cosine_decay_schedule"
    _check(fn, "init_value", init_value)
    _check(fn, "peak_value", peak_value)
    _check(fn, "end_value", end_value)
    _check(fn, "warmup_steps", warmup_steps, lo=0, integer=True)
    _check(fn, "decay_steps", decay_steps, lo=warmup_steps, integer=True,
           hint="decay_steps is the total schedule length and includes the warmup steps")
    _check(fn, "exponent", exponent, lo=0.0, lo_open=True)
    cos_steps = decay_steps - warmup_steps  # 0: straight to end_value after the warmup

    def f(t):
        warm = init_value + (peak_value - init_value) * (t / max(warmup_steps, 1))
        frac = ((t - warmup_steps) / cos_steps).clamp(0.0, 1.0) if cos_steps else torch.ones_like(t)
        cosine = (0.5 * (1.0 + torch.cos(math.pi * frac))) ** exponent
        decay = end_value + (peak_value - end_value) * cosine
        return torch.where(t < warmup_steps, warm, decay)

    return lambda step: _evaluate(step, f)


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i-1]`` on, each called with the steps since its start."""
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(f"cfx.optim.join_schedules: got {len(schedules)} schedules and "
                         f"{len(boundaries)} boundaries; pass one boundary fewer than schedules.")
    for i, b in enumerate(boundaries):
        _check("join_schedules", f"boundaries[{i}]", b, lo=0, integer=True)
    if list(boundaries) != sorted(boundaries):
        raise ValueError(f"cfx.optim.join_schedules: boundaries={list(boundaries)} must be sorted "
                         "in increasing order.")

    def schedule(step):
        if not isinstance(step, torch.Tensor):
            i = sum(step >= b for b in boundaries)
            return float(schedules[i](step - (boundaries[i - 1] if i else 0)))
        out = torch.as_tensor(schedules[0](step), dtype=torch.float32, device=step.device)
        for b, s in zip(boundaries, schedules[1:]):
            val = torch.as_tensor(s(step - b), dtype=torch.float32, device=step.device)
            out = torch.where(step >= b, val, out)
        return out

    return schedule
