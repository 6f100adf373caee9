"""Diffusion schedules as pure functions equal ``diffusers``' schedulers: ``add_noise``, the velocity
target, one DDPM step (same noise), a full 20-step DDIM trajectory (eta 0 and 1), a 20-step Euler
trajectory, for epsilon and v-prediction, linear and scaled-linear betas; classifier-free
guidance is its formula; bad timesteps are refused."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

diffusers = pytest.importorskip("diffusers")

from cfx._src.diffusion import schedulers as S  # noqa: E402
from cfx_tests.budget import examples  # noqa: E402

CONFIGS = [dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type="epsilon"),
           dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, prediction_type="v_prediction")]


def fake_model(x, t):
    """A deterministic stand-in for the UNet: depends on the sample and the timestep."""
    return 0.3 * torch.tanh(x) + 0.001 * float(t) * torch.cos(x)


def sample(seed, shape=(2, 4, 8, 8)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", CONFIGS, ids=["scaled_linear-eps", "linear-v"])
@examples(ci=5)
@given(seed=st.integers(0, 99), t=st.lists(st.integers(0, 999), min_size=2, max_size=2))
def test_add_noise_and_target_equal_diffusers(cfg, seed, t):
    sched = diffusers.DDPMScheduler(**cfg)
    schedule = S.Schedule.from_diffusers(sched)
    x0, noise, ts = sample(seed), sample(seed + 1), torch.tensor(t)
    torch.testing.assert_close(S.add_noise(schedule, x0, noise, ts), sched.add_noise(x0, noise, ts))
    want = noise if cfg["prediction_type"] == "epsilon" else sched.get_velocity(x0, noise, ts)
    torch.testing.assert_close(S.target(schedule, x0, noise, ts), want)
    torch.testing.assert_close(schedule.alphas_cumprod, sched.alphas_cumprod, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["scaled_linear-eps", "linear-v"])
@pytest.mark.parametrize("t", [0, 1, 500, 999])
def test_one_ddpm_step_equals_diffusers(cfg, t):
    sched = diffusers.DDPMScheduler(**cfg, clip_sample=False)
    schedule = S.Schedule.from_diffusers(sched)
    x = sample(3)
    out = fake_model(x, t)
    want = sched.step(out, t, x, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))  # what diffusers draws
    prev, x0 = S.ddpm_step(schedule, out, t, x, noise)
    torch.testing.assert_close(prev, want.prev_sample)
    torch.testing.assert_close(x0, want.pred_original_sample)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["scaled_linear-eps", "linear-v"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_a_20_step_ddim_trajectory_equals_diffusers(cfg, eta):
    sched = diffusers.DDIMScheduler(**cfg, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    sched.set_timesteps(20)
    schedule = S.Schedule.from_diffusers(sched)
    ts = S.ddim_timesteps(schedule, 20)
    assert torch.equal(ts, sched.timesteps)
    ours = theirs = sample(5)
    for t, prev_t in zip(ts.tolist(), [*ts.tolist()[1:], -1]):
        noise = torch.randn(ours.shape, generator=torch.Generator().manual_seed(t)) if eta else None
        theirs = sched.step(fake_model(theirs, t), t, theirs, eta=eta, variance_noise=noise).prev_sample
        ours, _ = S.ddim_step(schedule, fake_model(ours, t), t, prev_t, ours, eta=eta, noise=noise)
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["scaled_linear-eps", "linear-v"])
def test_a_20_step_euler_trajectory_equals_diffusers(cfg):
    sched = diffusers.EulerDiscreteScheduler(**cfg)
    sched.set_timesteps(20)
    schedule = S.Schedule.from_diffusers(sched)
    ts = S.euler_timesteps(schedule, 20)
    sigmas = S.euler_sigmas(schedule, ts)
    torch.testing.assert_close(ts, sched.timesteps)
    torch.testing.assert_close(sigmas, sched.sigmas)
    torch.testing.assert_close(S.euler_init_noise_sigma(sigmas), sched.init_noise_sigma)
    ours = theirs = sample(9) * sched.init_noise_sigma
    for i, t in enumerate(sched.timesteps):
        theirs = sched.step(fake_model(sched.scale_model_input(theirs, t), t), t, theirs).prev_sample
        ours, _ = S.euler_step(schedule, fake_model(S.euler_scale_input(ours, sigmas[i]), t), ours, sigmas[i],
                               sigmas[i + 1])
        torch.testing.assert_close(ours, theirs)


def test_guidance_is_the_formula_and_bad_input_is_refused():
    u, c = sample(1), sample(2)
    torch.testing.assert_close(S.guidance(u, c, 7.5), u + 7.5 * (c - u))
    torch.testing.assert_close(S.guidance(u, c, 1.0), c)  # scale 1: the conditional prediction
    schedule = S.Schedule()
    with pytest.raises(ValueError, match=r"timesteps must be integers in \[0, 1000\)"):
        S.add_noise(schedule, u, c, torch.tensor([1000]))
    with pytest.raises(ValueError, match="pass noise="):
        S.ddpm_step(schedule, u, 10, c)
    with pytest.raises(ValueError, match="prediction_type must be one of"):
        S.Schedule(prediction_type="sample")
    with pytest.raises(ValueError, match="steps must be in"):
        S.ddim_timesteps(schedule, 0)
