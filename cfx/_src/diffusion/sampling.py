"""Text-to-image sampling with a ``Pipeline``: DDIM over the UNet with classifier-free guidance,
then the VAE's decoder (diffusers' ``StableDiffusionPipeline``, step for step).

``sample(pipeline, cond, uncond, steps=, guidance_scale=, key=)`` starts from
``cfx.random.normal(key)`` latents (or given ``latents``), runs the UNet on the unconditional and
conditional text states in one batch each step, mixes them (``guidance``) and takes a DDIM step;
the result, decoded (``latents / scaling_factor``), is mapped from ``[-1, 1]`` to ``[0, 1]``.
``text_states(pipeline, token_ids)`` is the text encoder's last hidden state.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.diffusion.schedulers import ddim_step, ddim_timesteps, guidance


def text_states(p: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """The text encoder's last hidden state ``(B, T, C)`` for ``token_ids`` ``(B, T)``."""
    return p.text_encoder.apply(p.text_params, token_ids)[0]


def latent_shape(p: Any, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
    f = 2 ** p.vae.n_down
    multiple = f * 2 ** (len(p.unet.config.block_out_channels) - 1)  # the VAE's, then the UNet's downsampling
    if height % multiple or width % multiple:
        raise ValueError(f"sample: {height}x{width} pixels do not map to whole latents: use multiples of {multiple}.")
    return batch, p.unet.config.in_channels, height // f, width // f


@torch.no_grad()
def sample(p: Any, cond: torch.Tensor, uncond: torch.Tensor | None = None, *, steps: int = 25,
           guidance_scale: float = 7.5, key: torch.Tensor | None = None, height: int | None = None,
           width: int | None = None, latents: torch.Tensor | None = None,
           progress: Callable[[int], None] | None = None, decode: bool = True) -> torch.Tensor:
    """Images ``(B, 3, H, W)`` in ``[0, 1]`` (module doc); ``decode=False``: the final latents ``(B, C,
    h, w)`` instead (diffusers' ``output_type="latent"``). ``guidance_scale`` 1 runs the conditional
    prediction alone; any other scale steers away from ``uncond`` (the negative prompt's states)."""
    if guidance_scale != 1.0 and uncond is None:
        raise ValueError(f"sample: guidance_scale={guidance_scale} steers away from a negative prompt, but uncond is "
                         "None; pass uncond= (text_states of the negative prompt, e.g. of '' for none), or "
                         "guidance_scale=1.0 for the conditional prediction alone.")
    if uncond is not None and tuple(uncond.shape) != tuple(cond.shape):
        raise ValueError(f"sample: uncond {tuple(uncond.shape)} must be shaped like cond {tuple(cond.shape)} (the "
                         "negative prompt tokenized to the same length, one row per image).")
    if latents is None:
        if key is None:
            raise ValueError("sample: pass key= (a cfx.random key) for the starting noise, or latents=.")
        size = p.unet.config.sample_size * 2 ** p.vae.n_down
        shape = latent_shape(p, cond.shape[0], height or size, width or size)
        latents = random.normal(key, shape, dtype=cond.dtype)
    guided = guidance_scale != 1.0
    states = torch.cat([uncond, cond]) if guided else cond
    ts = ddim_timesteps(p.schedule, steps).tolist()
    x = latents
    for i, (t, prev) in enumerate(zip(ts, [*ts[1:], -1])):
        out = p.unet.apply(p.unet_params, torch.cat([x, x]) if guided else x, t, states)
        if guided:
            out_u, out_c = out.chunk(2)
            out = guidance(out_u, out_c, guidance_scale)
        x, _ = ddim_step(p.schedule, out, t, prev, x)
        if progress is not None:
            progress(i)
    if not decode:
        return x
    shift = p.vae.config.shift_factor or 0.0
    image = p.vae.decode(p.vae_params, x / p.vae.config.scaling_factor + shift)
    return (image / 2 + 0.5).clamp(0, 1)
