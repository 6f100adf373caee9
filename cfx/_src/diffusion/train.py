"""The denoising objective: what one Stable Diffusion training step minimises.

``denoising_loss(unet, schedule, params, latents, text_states, t, noise)``: the latents noised to
timestep ``t`` (``add_noise``), the UNet's prediction from them, and its mean squared error
against ``target`` (the noise, or the velocity under ``v_prediction``), in fp32 or wider -- diffusers'
``train_text_to_image.py`` loss. ``draw(schedule, key, latents)`` draws ``t`` uniformly and the
noise from a ``cfx.random`` key, so a step is a pure function of its key.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src import random
from cfx._src.diffusion.schedulers import Schedule, add_noise, target


def draw(schedule: Schedule, key: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, noise)`` for a batch of ``latents``: ``t`` uniform over the training timesteps."""
    k_t, k_n = random.split(key, 2)
    t = random.randint(k_t, (latents.shape[0],), 0, schedule.num_train_timesteps)
    return t, random.normal(k_n, tuple(latents.shape), dtype=latents.dtype)


def denoising_loss(unet: Any, schedule: Schedule, params: Any, latents: torch.Tensor, text_states: torch.Tensor,
                   t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the UNet's prediction at ``add_noise(latents, noise, t)`` (module doc)."""
    noisy = add_noise(schedule, latents, noise, t)
    pred = unet.apply(params, noisy, t, text_states)
    want = target(schedule, latents, noise, t)
    return torch.nn.functional.mse_loss(pred.to(torch.promote_types(pred.dtype, torch.float32)),
                                        want.to(torch.promote_types(want.dtype, torch.float32)))
