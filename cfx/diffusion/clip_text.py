"""The CLIP text encoder (``transformers.CLIPTextModel``) and its weight and config converters."""
from cfx._src.diffusion.clip_text import (CLIPTextConfig, CLIPTextEncoder, clip_text, config_from_hf, from_hf, hf_config,
                                          to_hf_state_dict)

__all__ = ["CLIPTextConfig", "CLIPTextEncoder", "clip_text", "config_from_hf", "from_hf", "hf_config", "to_hf_state_dict"]
