"""The denoising objective: what one Stable Diffusion training step minimises.

``denoising_loss(unet, schedule, params, latents, text_states, t, noise)``: the latents noised to
timestep ``t`` (``add_noise``), the UNet's prediction from them, and its mean squared error
against ``target`` (the noise, or the velocity under ``v_prediction``), in fp32 or wider -- diffusers'
``train_text_to_image.py`` loss. ``draw(schedule, key, latents)`` draws ``t`` uniformly and the
noise from a ``cfx.random`` key, so a step is a pure function of its key.

``Denoiser(unet, schedule)`` is that objective as a model a ``cfx.parallel.Plan`` trains: the
UNet's params, init and axes; ``loss(params, latents, text_states, t, noise[, weights])``; a batch
of those tensors whose rows split over ``data`` (the noise and timesteps are drawn outside the step,
so every plan computes the same numbers); and the UNet's resnets and transformers as its
``blocks``, so ZeRO-3 gathers and remat wrap them one by one and ``tensor_parallel`` splits them
over a model axis.

``lora_denoiser(unet, schedule, base, config, adapters)`` is the same objective over LoRA adapters
(``cfx.lora``) of a frozen UNet: a loss function of the adapters alone, whose params, gradients and optimizer
state are the adapters'. ``frozen_base`` makes that UNet's params fp32, bf16 or int8 (QLoRA's recipe; ``unet_base``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random
from cfx._src.diffusion.composite import Composite
from cfx._src.diffusion.schedulers import Schedule, add_noise, target
from cfx._src.lora.adapters import attach
from cfx._src.lora.config import LoraConfig
from cfx._src.models.function import LossModel
from cfx._src.nn.sublayers import keep_sublayers
from cfx._src.lora.frozen import frozen_base

BASES = ("fp32", "bf16", "int8")  # the frozen UNet's weights under LoRA


def draw(schedule: Schedule, key: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, noise)`` for a batch of ``latents``: ``t`` uniform over the training timesteps."""
    k_t, k_n = random.split(key, 2)
    t = random.randint(k_t, (latents.shape[0],), 0, schedule.num_train_timesteps)
    return t, random.normal(k_n, tuple(latents.shape), dtype=latents.dtype)


def denoising_loss(unet: Any, schedule: Schedule, params: Any, latents: torch.Tensor, text_states: torch.Tensor,
                   t: torch.Tensor, noise: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error of the UNet's prediction at ``add_noise(latents, noise, t)`` (module doc);
    with ``weights`` ``(B,)``, the mean over rows of each row's error times its weight (DreamBooth's
    instance + prior loss: 2 on instance rows, 2 x prior_weight on class rows, half of each)."""
    noisy = add_noise(schedule, latents, noise, t)
    pred = unet.apply(params, noisy, t, text_states)
    want = target(schedule, latents, noise, t)
    pred, want = (x.to(torch.promote_types(x.dtype, torch.float32)) for x in (pred, want))
    if weights is None:
        return torch.nn.functional.mse_loss(pred, want)
    per_row = torch.nn.functional.mse_loss(pred, want, reduction="none").flatten(1).mean(1)  # (B,)
    return (per_row * weights.to(per_row.dtype)).mean()


@dataclasses.dataclass(frozen=True)
class Denoiser(Composite):
    """``unet`` trained on ``schedule``'s denoising objective (module doc). Its params are the
    UNet's (the same tree); a batch is ``(latents (B, C, H, W), text_states (B, S, D), t (B,),
    noise (B, C, H, W))``."""

    unet: Any
    schedule: Schedule
    batch_axes = ("batch",)  # every batch tensor splits its rows over data, nothing else

    def __post_init__(self):
        keep_sublayers(self, self.unet._sublayers)  # the UNet's own: one params tree

    @property
    def blocks(self) -> tuple:
        return self.unet.blocks

    def map_blocks(self, f: Any) -> "Denoiser":
        return Denoiser(self.unet.map_blocks(f), self.schedule)

    def tensor_parallel(self, axis: str) -> "Denoiser":
        """Every resnet and transformer Megatron-split over ``axis`` (``diffusion.parallel``)."""
        from cfx._src.diffusion.parallel import tensor_parallel_block
        return self.map_blocks(lambda b: tensor_parallel_block(b, axis))

    def apply(self, params: Any, sample: torch.Tensor, timestep: Any, text_states: torch.Tensor) -> torch.Tensor:
        return self.unet.apply(params, sample, timestep, text_states)

    def loss(self, params: Any, latents: torch.Tensor, text_states: torch.Tensor, t: torch.Tensor,
             noise: torch.Tensor, weights: torch.Tensor | None = None, *, key: Any = None) -> torch.Tensor:
        del key  # no dropout in the UNet
        return denoising_loss(self.unet, self.schedule, params, latents, text_states, t, noise, weights)

    def check_train_batch(self, batch: Any, where: str) -> None:
        """ValueError unless ``batch`` is ``(latents, text_states, t, noise[, weights])`` for this UNet."""
        if not (isinstance(batch, (tuple, list)) and len(batch) in (4, 5)
                and all(isinstance(x, torch.Tensor) for x in batch)):
            raise ValueError(f"{where}: a Denoiser's batch is (latents, text_states, t, noise), four tensors (and "
                             "optionally per-row weights); got "
                             f"{type(batch).__name__} of {len(batch) if isinstance(batch, (tuple, list)) else '?'}.")
        latents, text_states, t, noise = batch[:4]
        self.unet.check_inputs(latents, text_states)
        B = latents.shape[0]
        if tuple(noise.shape) != tuple(latents.shape) or tuple(t.shape) != (B,) or any(
                tuple(w.shape) != (B,) for w in batch[4:]):
            raise ValueError(f"{where}: noise must be shaped like the latents {tuple(latents.shape)} and t (and the "
                             f"weights) be ({B},); got noise {tuple(noise.shape)}, t {tuple(t.shape)}"
                             f"{''.join(f' and weights {tuple(w.shape)}' for w in batch[4:])} "
                             "(cfx.diffusion.draw makes t and noise).")


def unet_base(unet: Any, params: Any, base: str) -> Any:
    """``params`` of ``unet`` as LoRA's frozen base (``cfx.lora.frozen_base``): fp32, bf16, or int8 (every
    Linear and conv weight, however small, weight-only int8 per output channel; the norms and biases fp32)."""
    if base not in BASES:
        raise ValueError(f"frozen_base: base must be one of {BASES}, got {base!r}.")
    return frozen_base(params, unet.axes(), base, min_size=0)


def lora_denoiser(unet: Any, schedule: Schedule, base: Any, config: LoraConfig, adapters: Any) -> LossModel:
    """``denoising_loss`` over LoRA adapters of ``unet`` with the frozen params ``base`` (module doc):
    ``loss(adapters, latents, text_states, t, noise[, weights], key=)``, ``key`` drawing the adapters'
    dropout; it starts from ``adapters`` (``cfx.lora.init(unet, config, key)``). A ``cfx.parallel.Plan``
    trains it over ``data`` (ZeRO, offload, the whole step recomputed under remat), keeping ``base`` as
    it keeps the adapters (``LossModel(frozen=)``): under ZeRO-3 each rank holds ``1/n`` of it, gathered
    around the loss, in host memory or files under offload."""

    def lora_loss(adapters: Any, latents: torch.Tensor, text_states: torch.Tensor, t: torch.Tensor,
                  noise: torch.Tensor, weights: torch.Tensor | None = None, *, frozen: Any,
                  key: Any = None) -> torch.Tensor:
        params = attach(frozen, adapters, config, key=key)
        return denoising_loss(unet, schedule, params, latents, text_states, t, noise, weights)

    return LossModel(lora_loss, params=adapters, frozen=base)
