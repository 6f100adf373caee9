"""Stable Diffusion's models as pure functions over params (issue 19): the UNet, the VAE, the CLIP text encoder."""
