"""Diffusion schedules as pure functions of a ``Schedule`` (equal to diffusers' DDPM / DDIM / Euler
schedulers step for step): noising, training targets, sampler steps and timesteps, guidance."""
from cfx._src.diffusion.schedulers import (Schedule, add_noise, check_timesteps, ddim_step, ddim_timesteps, ddpm_step,
                                           euler_init_noise_sigma, euler_scale_input, euler_sigmas, euler_step,
                                           euler_timesteps, guidance, target, velocity)

__all__ = ["Schedule", "add_noise", "check_timesteps", "ddim_step", "ddim_timesteps", "ddpm_step", "euler_init_noise_sigma",
           "euler_scale_input", "euler_sigmas", "euler_step", "euler_timesteps", "guidance", "target", "velocity"]
