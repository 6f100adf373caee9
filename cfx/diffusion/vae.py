"""Stable Diffusion's VAE (``diffusers.AutoencoderKL``) and its weight converters."""
from cfx._src.diffusion.vae import AutoencoderKL, AutoencoderKLConfig, from_diffusers, to_diffusers_state_dict

__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "from_diffusers", "to_diffusers_state_dict"]
