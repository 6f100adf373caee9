"""Diffusion schedules and samplers as pure functions of explicit state (the ``diffusers`` numbers).

A ``Schedule`` is the forward process: ``betas`` (``linear`` or Stable Diffusion's
``scaled_linear``) and ``alphas_cumprod``, fp32 as ``diffusers`` computes them, and what the model
predicts (``epsilon`` or ``v_prediction``). Training draws ``t`` and noise, ``add_noise`` makes
``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` and ``target`` is what the loss regresses to.
Sampling is a loop the caller writes -- every step a pure function of the model's output, the
current sample and the timesteps (no object with a hidden step counter)::

    ts = ddim_timesteps(schedule, 25)
    x = noise
    for t, prev in zip(ts, [*ts[1:], -1]):
        eps = guidance(unet(x, t, uncond), unet(x, t, cond), scale=7.5)
        x = ddim_step(schedule, eps, t, prev, x)

``ddpm_step`` (ancestral, ``fixed_small`` variance; the noise is an argument), ``ddim_step``
(``eta`` >= 0; SD's ``set_alpha_to_one=False``), and Euler (``euler_sigmas``, ``euler_scale_input``,
``euler_step``) equal ``DDPMScheduler`` / ``DDIMScheduler`` / ``EulerDiscreteScheduler`` step for
step; ``guidance`` is classifier-free guidance.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

PREDICTIONS = ("epsilon", "v_prediction")
SPACINGS = ("leading", "linspace", "trailing")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The forward process (defaults: Stable Diffusion 1.x's)."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    prediction_type: str = "epsilon"

    def __post_init__(self):
        if self.beta_schedule not in ("linear", "scaled_linear"):
            raise ValueError(f"Schedule: beta_schedule {self.beta_schedule!r} is not supported; use 'linear' or "
                             "'scaled_linear'.")
        if self.prediction_type not in PREDICTIONS:
            raise ValueError(f"Schedule: prediction_type must be one of {PREDICTIONS}, got {self.prediction_type!r}.")
        if self.num_train_timesteps < 2:
            raise ValueError(f"Schedule: num_train_timesteps must be >= 2, got {self.num_train_timesteps}.")

    @classmethod
    def from_diffusers(cls, config: Any) -> "Schedule":
        """From a ``diffusers`` scheduler's config (or the scheduler)."""
        c = getattr(config, "config", config)
        get = c.get if isinstance(c, dict) else lambda k, d=None: getattr(c, k, d)
        return cls(get("num_train_timesteps", 1000), get("beta_start", 0.0001), get("beta_end", 0.02),
                   get("beta_schedule", "linear"), get("prediction_type", "epsilon"))

    @property
    def betas(self) -> torch.Tensor:
        n = self.num_train_timesteps
        if self.beta_schedule == "linear":
            return torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float32)
        return torch.linspace(self.beta_start ** 0.5, self.beta_end ** 0.5, n, dtype=torch.float32) ** 2

    @property
    def alphas_cumprod(self) -> torch.Tensor:
        return torch.cumprod(1.0 - self.betas, dim=0)


def _at(values: torch.Tensor, t: Any, like: torch.Tensor) -> torch.Tensor:
    """``values[t]`` shaped to broadcast over ``like`` (B, ...) for an int, 0-d or (B,) ``t``."""
    t = torch.as_tensor(t, dtype=torch.long)
    out = values.to(like.device)[t.to(like.device)].to(like.dtype)
    return out.reshape(-1, *([1] * (like.dim() - 1))) if out.dim() else out


def check_timesteps(schedule: Schedule, t: Any) -> None:
    t = torch.as_tensor(t)
    if t.is_floating_point() or (t.numel() and (int(t.min()) < 0 or int(t.max()) >= schedule.num_train_timesteps)):
        raise ValueError(f"diffusion: timesteps must be integers in [0, {schedule.num_train_timesteps}), got "
                         f"{t.tolist() if t.numel() < 8 else tuple(t.shape)}.")


# -- training ------------------------------------------------------------------------------------------
def add_noise(schedule: Schedule, x0: torch.Tensor, noise: torch.Tensor, t: Any) -> torch.Tensor:
    """``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` (``DDPMScheduler.add_noise``)."""
    check_timesteps(schedule, t)
    a = _at(schedule.alphas_cumprod, t, x0)
    return a ** 0.5 * x0 + (1 - a) ** 0.5 * noise


def velocity(schedule: Schedule, x0: torch.Tensor, noise: torch.Tensor, t: Any) -> torch.Tensor:
    """``v = sqrt(a_t) noise - sqrt(1 - a_t) x_0`` (``get_velocity``)."""
    check_timesteps(schedule, t)
    a = _at(schedule.alphas_cumprod, t, x0)
    return a ** 0.5 * noise - (1 - a) ** 0.5 * x0


def target(schedule: Schedule, x0: torch.Tensor, noise: torch.Tensor, t: Any) -> torch.Tensor:
    """What the model regresses to: the noise (``epsilon``) or the velocity (``v_prediction``)."""
    return noise if schedule.prediction_type == "epsilon" else velocity(schedule, x0, noise, t)


def _x0_eps(schedule: Schedule, out: torch.Tensor, sample: torch.Tensor, a: torch.Tensor):
    """``(predicted x_0, predicted noise)`` from the model's output at cumulative alpha ``a``."""
    if schedule.prediction_type == "epsilon":
        return (sample - (1 - a) ** 0.5 * out) / a ** 0.5, out
    return a ** 0.5 * sample - (1 - a) ** 0.5 * out, a ** 0.5 * out + (1 - a) ** 0.5 * sample


# -- DDPM ----------------------------------------------------------------------------------------------
def ddpm_step(schedule: Schedule, out: torch.Tensor, t: int, sample: torch.Tensor, noise: torch.Tensor | None = None,
              *, prev_t: int | None = None, clip_sample: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_prev, predicted x_0)``: one ancestral step from ``t`` to ``prev_t`` (default ``t - 1``)
    with the ``fixed_small`` variance; ``noise`` (needed for ``t > 0``) is drawn by the caller.
    ``clip_sample``: clamp x_0 to ``[-c, c]`` (diffusers' ``clip_sample_range``; SD does not clip)."""
    check_timesteps(schedule, t)
    acp = schedule.alphas_cumprod
    prev_t = t - 1 if prev_t is None else prev_t
    a_t = acp[t]
    a_prev = acp[prev_t] if prev_t >= 0 else torch.tensor(1.0)
    alpha_t, beta_t = a_t / a_prev, 1 - a_t / a_prev
    x0, _ = _x0_eps(schedule, out, sample, a_t)
    if clip_sample is not None:
        x0 = x0.clamp(-clip_sample, clip_sample)
    mean = (a_prev ** 0.5 * beta_t) / (1 - a_t) * x0 + alpha_t ** 0.5 * (1 - a_prev) / (1 - a_t) * sample
    if t == 0:
        return mean, x0
    if noise is None:
        raise ValueError("ddpm_step: a step from t > 0 adds noise; pass noise= (e.g. cfx.random.normal(key, x.shape)).")
    variance = torch.clamp((1 - a_prev) / (1 - a_t) * beta_t, min=1e-20)
    return mean + variance ** 0.5 * noise, x0


# -- DDIM ----------------------------------------------------------------------------------------------
def ddim_timesteps(schedule: Schedule, steps: int, *, spacing: str = "leading", steps_offset: int = 1) -> torch.Tensor:
    """The ``steps`` timesteps of a sampling run, first to last (``DDIMScheduler.set_timesteps``; SD:
    ``leading`` spacing, ``steps_offset=1``)."""
    n = schedule.num_train_timesteps
    if not 1 <= steps <= n:
        raise ValueError(f"ddim_timesteps: steps must be in [1, {n}], got {steps}.")
    if spacing == "linspace":
        ts = np.linspace(0, n - 1, steps).round()[::-1].copy().astype(np.int64)
    elif spacing == "leading":
        ts = (np.arange(0, steps) * (n // steps)).round()[::-1].copy().astype(np.int64) + steps_offset
    elif spacing == "trailing":
        ts = np.round(np.arange(n, 0, -n / steps)).astype(np.int64) - 1
    else:
        raise ValueError(f"ddim_timesteps: spacing must be one of {SPACINGS}, got {spacing!r}.")
    return torch.from_numpy(ts)


def ddim_step(schedule: Schedule, out: torch.Tensor, t: int, prev_t: int, sample: torch.Tensor, *, eta: float = 0.0,
              noise: torch.Tensor | None = None, set_alpha_to_one: bool = False,
              clip_sample: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_prev, predicted x_0)``: one DDIM step from ``t`` to ``prev_t`` (``-1``: the end, where
    the cumulative alpha is ``alphas_cumprod[0]``, or 1 with ``set_alpha_to_one``)."""
    acp = schedule.alphas_cumprod
    a_t = acp[int(t)]
    a_prev = acp[int(prev_t)] if prev_t >= 0 else (torch.tensor(1.0) if set_alpha_to_one else acp[0])
    x0, eps = _x0_eps(schedule, out, sample, a_t)
    if clip_sample is not None:
        x0 = x0.clamp(-clip_sample, clip_sample)
    std = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) ** 0.5
    prev = a_prev ** 0.5 * x0 + (1 - a_prev - std ** 2) ** 0.5 * eps
    if eta > 0:
        if noise is None:
            raise ValueError("ddim_step: eta > 0 adds noise; pass noise= (e.g. cfx.random.normal(key, x.shape)).")
        prev = prev + std * noise
    return prev, x0


# -- Euler ---------------------------------------------------------------------------------------------
def euler_timesteps(schedule: Schedule, steps: int, *, spacing: str = "linspace", steps_offset: int = 0) -> torch.Tensor:
    """Timesteps (float) of an Euler run (``EulerDiscreteScheduler.set_timesteps``)."""
    n = schedule.num_train_timesteps
    if spacing == "linspace":
        ts = np.linspace(0, n - 1, steps, dtype=np.float32)[::-1].copy()
    elif spacing == "leading":
        ts = (np.arange(0, steps) * (n // steps)).round()[::-1].copy().astype(np.float32) + steps_offset
    elif spacing == "trailing":
        ts = np.arange(n, 0, -n / steps).round().copy().astype(np.float32) - 1
    else:
        raise ValueError(f"euler_timesteps: spacing must be one of {SPACINGS}, got {spacing!r}.")
    return torch.from_numpy(ts)


def euler_sigmas(schedule: Schedule, timesteps: torch.Tensor) -> torch.Tensor:
    """``sigma`` at each timestep (interpolated in t), then a final 0: ``(steps + 1,)``."""
    acp = schedule.alphas_cumprod
    sigmas = np.array(((1 - acp) / acp) ** 0.5)
    sigmas = np.interp(timesteps.numpy(), np.arange(0, len(sigmas)), sigmas)
    return torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))


def euler_init_noise_sigma(sigmas: torch.Tensor, *, spacing: str = "linspace") -> torch.Tensor:
    """The standard deviation of the starting noise."""
    top = sigmas.max()
    return top if spacing in ("linspace", "trailing") else (top ** 2 + 1) ** 0.5


def euler_scale_input(sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The model's input at noise level ``sigma``: ``sample / sqrt(sigma^2 + 1)``."""
    return sample / ((sigma ** 2 + 1) ** 0.5)


def euler_step(schedule: Schedule, out: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_next, predicted x_0)``: one Euler step from ``sigma`` to ``sigma_next`` (no churn)."""
    if schedule.prediction_type == "epsilon":
        x0 = sample - sigma * out
    else:
        x0 = out * (-sigma / (sigma ** 2 + 1) ** 0.5) + sample / (sigma ** 2 + 1)
    prev = sample + (sample - x0) / sigma * (sigma_next - sigma)
    return prev.to(out.dtype), x0


# -- guidance ------------------------------------------------------------------------------------------
def guidance(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)``."""
    return uncond + scale * (cond - uncond)
