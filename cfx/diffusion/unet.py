"""Stable Diffusion's UNet (``diffusers.UNet2DConditionModel``) and its weight converters."""
from cfx._src.diffusion.unet import UNet2DCondition, from_diffusers, timestep_embedding, to_diffusers_state_dict
from cfx._src.diffusion.unet_config import UNet2DConditionConfig

__all__ = ["UNet2DCondition", "UNet2DConditionConfig", "from_diffusers", "timestep_embedding", "to_diffusers_state_dict"]
