"""Stable Diffusion on cfx: its three models as pure functions over params, with weights
interchangeable with ``diffusers`` / ``transformers``, and its schedules as pure functions.

``UNet2DCondition`` (``diffusers.UNet2DConditionModel``: ``apply(params, sample, timestep,
encoder_hidden_states) -> noise prediction``), ``AutoencoderKL`` (``encode -> (mean, logvar)``,
``sample_latents``, ``decode``), ``CLIPTextEncoder`` (``transformers.CLIPTextModel``: ``apply(params,
tokens, mask=) -> (hidden, pooled)``); each module's ``from_diffusers`` / ``from_hf`` and
``to_diffusers_state_dict`` / ``to_hf_state_dict`` convert weights. ``Schedule`` and the functions
of ``schedulers`` (``add_noise``, ``target``, ``ddpm_step``, ``ddim_step``, Euler, ``guidance``)
equal diffusers' DDPM / DDIM / Euler schedulers step for step. ``denoising_loss`` is the training
objective (diffusers' ``train_text_to_image.py`` loss) and ``draw`` its timesteps and noise from a key;
``Denoiser(unet, schedule)`` is that objective as a model ``cfx.parallel.Plan`` trains (ZeRO, offload,
remat per block, bf16, tensor parallelism over ``model``); ``python -m cfx.diffusion.train`` and ``python -m cfx.diffusion.dreambooth``
are its command lines.
``load_pipeline(dir)`` / ``save_pipeline(dir, pipeline)`` read and write diffusers' pipeline layout
(``unet/``, ``vae/``, ``text_encoder/``, ``scheduler/``); ``sample_images`` draws images (DDIM
with classifier-free guidance, as ``StableDiffusionPipeline``), and ``python -m cfx.diffusion.sample``
is its command line (the module ``cfx.diffusion.sample``); ``tiny_pipeline(dir)`` writes a tiny random
pipeline with a tokenizer to try the command lines offline.
"""
from cfx.diffusion import clip_text, schedulers, unet, vae
from cfx._src.diffusion.train import Denoiser, denoising_loss, draw
from cfx._src.diffusion.clip_text import CLIPTextConfig, CLIPTextEncoder
from cfx._src.diffusion.pipeline import Pipeline, load_pipeline, save_pipeline
from cfx._src.diffusion.sampling import sample as sample_images
from cfx._src.diffusion.sampling import text_states
from cfx._src.diffusion.schedulers import Schedule, add_noise, ddim_step, ddim_timesteps, ddpm_step, guidance, target
from cfx._src.diffusion.unet import UNet2DCondition, UNet2DConditionConfig
from cfx._src.diffusion.tiny import tiny_pipeline
from cfx._src.diffusion.vae import AutoencoderKL, AutoencoderKLConfig

__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "CLIPTextConfig", "CLIPTextEncoder", "Denoiser", "Pipeline", "Schedule",
           "UNet2DCondition", "load_pipeline", "sample_images", "save_pipeline", "text_states",
           "UNet2DConditionConfig", "add_noise", "clip_text", "ddim_step", "ddim_timesteps", "ddpm_step", "denoising_loss",
           "draw", "guidance",
           "schedulers", "target", "tiny_pipeline", "unet", "vae"]
