"""DreamBooth with prior preservation (Ruiz et al. 2022), as diffusers' ``train_dreambooth.py``
runs it: what ``python -m cfx.diffusion.dreambooth`` trains.

A few instance images of one subject, all captioned with one instance prompt ("a photo of sks
dog"), teach the UNet the subject; images the BASE pipeline draws for the class prompt ("a photo
of a dog") keep it from forgetting the class (the prior) and from collapsing every dog onto sks:

1. ``write_class_images``: the base pipeline draws the class prompt's missing images (DDIM with
   classifier-free guidance against the empty prompt; image ``i`` from ``fold_in(key, i)``'s
   latents, so which images a directory already holds does not change the others) into the
   class directory as PNGs; images already there are reused, as diffusers does;
2. ``class_data``: those images read back and encoded with the class prompt (the instance images
   likewise with the instance prompt, ``finetune.encode``);
3. ``batches``: each step ``batch_size`` instance rows and ``batch_size`` class rows (each set its
   own permutation per epoch), their latents, timesteps and noise drawn together
   (``finetune.batch_at``), and per-row weights as the batch's fifth tensor: 2 on instance rows,
   ``2 * prior_loss_weight`` on class rows, so the weighted mean over the ``2 * batch_size`` rows
   is diffusers' ``mse(instance) + prior_loss_weight * mse(class)``. ``klass=None`` (no prior)
   trains on the instance rows alone, unweighted: plain fine-tuning.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.diffusion.data import EXTENSIONS, load_images, write_png
from cfx._src.diffusion.finetune import Encoded, batch_at, encode, rows_of
from cfx._src.diffusion.pipeline import Pipeline
from cfx._src.diffusion.sampling import latent_shape, sample, text_states


def images_in(directory: str) -> list[str]:
    """The image files in ``directory`` (sorted; none where it does not exist)."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n.lower().endswith(EXTENSIONS))


def write_class_images(pipe: Pipeline, tokenize: Callable[[Any], torch.Tensor], prompt: str, directory: str,
                       count: int, *, height: int, width: int, steps: int, guidance_scale: float, key: torch.Tensor,
                       chunk: int = 4, progress: bool = True) -> int:
    """Draws the images ``directory`` lacks to hold ``count`` (module doc, step 1), ``chunk`` per
    UNet batch, each ``height`` x ``width`` pixels; returns how many it drew."""
    from tqdm.auto import tqdm

    have = images_in(directory)
    missing = count - len(have)
    if missing <= 0:
        return 0
    os.makedirs(directory, exist_ok=True)
    cond, uncond = text_states(pipe, tokenize(prompt)), text_states(pipe, tokenize(""))  # (1, S, D) each
    shape = latent_shape(pipe, 1, height, width)
    taken, names, i = set(have), [], 0
    while len(names) < missing:  # fresh names: a user's own class images are never overwritten
        name = f"class_{i:04d}.png"
        if name not in taken:
            names.append(name)
        i += 1
    with tqdm(total=missing * steps, desc=f"class images ({missing})", unit="step", disable=not progress) as bar:
        for start in range(0, missing, chunk):
            index = range(len(have) + start, len(have) + min(start + chunk, missing))
            latents = torch.cat([random.normal(random.fold_in(key, j), shape, dtype=cond.dtype) for j in index])
            n = len(index)
            images = sample(pipe, cond.expand(n, -1, -1), uncond.expand(n, -1, -1), steps=steps,
                            guidance_scale=guidance_scale, latents=latents,
                            progress=lambda _, n=n: bar.update(n))  # (n, 3, H, W) in [0, 1]
            for name, image in zip(names[start:start + n], images.cpu()):
                write_png(image, os.path.join(directory, name))
    return missing


def read_images(flag: str, directory: str, *, resolution: int | None, count: int | None = None) -> torch.Tensor:
    """``(N, 3, H, W)`` in ``[-1, 1]``: the first ``count`` (all) images of ``directory``, each
    ValueError naming ``flag``."""
    try:
        images, _, _ = load_images(directory, resolution=resolution, captions=False)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return images[:count]


def class_data(pipe: Pipeline, tokenize: Callable[[Any], torch.Tensor], prompt: str, directory: str, count: int, *,
               size: tuple[int, int], resolution: int | None, steps: int, guidance_scale: float, key: torch.Tensor,
               progress: bool = True) -> tuple[Encoded, int]:
    """``(the first count class images encoded with prompt, how many were drawn)``: the missing ones
    drawn by ``pipe`` (``write_class_images``, the instance images' ``size`` (H, W)) before any
    training, then read back (``resolution`` as for the instance images)."""
    (H, W) = size
    drawn = write_class_images(pipe, tokenize, prompt, directory, count, height=H, width=W, steps=steps,
                               guidance_scale=guidance_scale, key=key, progress=progress)
    images = read_images("--class-dir", directory, resolution=resolution, count=count)  # (count, 3, h, w)
    h, w = images.shape[2:]
    if (h, w) != (H, W):
        raise ValueError(f"--class-dir {directory!r}: its images are {h}x{w} pixels, the instance images {H}x{W}; "
                         "give --resolution N to resize and center-crop both, or empty --class-dir to draw them again.")
    return encode(pipe, images, tokenize([prompt] * len(images))), drawn


def batches(pipe: Pipeline, instance: Encoded, klass: Encoded | None, *, batch_size: int,
            prior_loss_weight: float, key: torch.Tensor) -> Callable[[int], tuple]:
    """``step -> (latents, text_states, t, noise, weights)`` (module doc, step 3); without
    ``klass``, ``step -> (latents, text_states, t, noise)`` of the instance rows alone."""
    k_instance, k_class, k_steps = random.split(key, 3)
    if klass is None:
        return lambda step: batch_at(pipe, instance, rows_of(len(instance), batch_size, step, k_instance),
                                     random.fold_in(k_steps, step))
    both = Encoded(*(torch.cat([a, b]) for a, b in zip((instance.mean, instance.logvar, instance.text),
                                                         (klass.mean, klass.logvar, klass.text))))
    weights = torch.tensor([2.0] * batch_size + [2.0 * prior_loss_weight] * batch_size,
                           device=instance.mean.device)  # (2B,): instance rows, then class rows

    def at(step: int) -> tuple:
        rows = torch.cat([rows_of(len(instance), batch_size, step, k_instance),
                          len(instance) + rows_of(len(klass), batch_size, step, k_class)])  # (2B,)
        return (*batch_at(pipe, both, rows, random.fold_in(k_steps, step)), weights)
    return at
