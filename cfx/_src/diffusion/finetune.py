"""Training a pipeline's UNet under a ``cfx.parallel.Plan``: what ``python -m cfx.diffusion.train``
and ``python -m cfx.diffusion.dreambooth`` run.

1. ``encode``: the frozen VAE and text encoder run once over the images and captions (no
   gradients), keeping each image's latent posterior ``(mean, logvar)`` and its caption's states;
2. ``fine_tune``: each step draws its rows (a permutation per epoch), latents from the posteriors,
   timesteps and noise from ``fold_in(key, step)`` -- so a run is a pure function of its seed and
   every plan computes the same steps -- and runs the plan's step on the ``cfx.diffusion.Denoiser``
   (ZeRO, offload, remat per block, precision); a progress bar shows the loss;
3. ``save``: the pipeline with the trained UNet in diffusers' layout (its tokenizer copied), and the
   train state (params and optimizer, ``Program.save``) for ``resume``.

Under LoRA the model is ``lora_denoiser`` (the adapters of a frozen UNet train) and ``write_lora``
saves the adapters as diffusers' LoRA file instead of the pipeline.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.diffusion.lora import save_diffusers
from cfx._src.diffusion.pipeline import Pipeline, save_pipeline
from cfx._src.diffusion.train import Denoiser, draw
from cfx._src.lora.config import LoraConfig
from cfx._src.precision.quant import floating_dtype

STATE_DIR = "train_state"  # the resumable state inside an output directory


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Images and captions as the UNet trains on them (module doc, step 1)."""

    mean: torch.Tensor     # (N, C, h, w) the VAE posterior's mean
    logvar: torch.Tensor   # (N, C, h, w)
    text: torch.Tensor     # (N, S, D) the text encoder's last hidden states

    def __len__(self) -> int:
        return self.mean.shape[0]


@torch.no_grad()
def encode(pipe: Pipeline, images: torch.Tensor, token_ids: torch.Tensor, *, chunk: int = 8,
           progress: Callable[[int], None] | None = None) -> Encoded:
    """``images`` ``(N, 3, H, W)`` in ``[-1, 1]`` and their ``token_ids`` ``(N, S)`` through the
    frozen VAE encoder and text encoder, ``chunk`` at a time."""
    means, logvars, texts = [], [], []
    dtype = floating_dtype(pipe.vae_params)
    for i in range(0, images.shape[0], chunk):
        mean, logvar = pipe.vae.encode(pipe.vae_params, images[i:i + chunk].to(dtype))
        means.append(mean)
        logvars.append(logvar)
        texts.append(pipe.text_encoder.apply(pipe.text_params, token_ids[i:i + chunk])[0])
        if progress is not None:
            progress(min(chunk, images.shape[0] - i))
    return Encoded(torch.cat(means), torch.cat(logvars), torch.cat(texts))


def rows_of(n: int, batch: int, step: int, key: torch.Tensor) -> torch.Tensor:
    """Step ``step``'s ``batch`` row indices into ``n`` examples: consecutive slices of one
    permutation per epoch (drawn from ``key``), wrapping into the next epoch's."""
    idx = torch.arange(step * batch, (step + 1) * batch)
    epochs = (idx // n).tolist()
    perms = {e: torch.argsort(random.uniform(random.fold_in(key, e), (n,))) for e in set(epochs)}
    return torch.stack([perms[e][i % n] for e, i in zip(epochs, idx.tolist())])


def batch_at(pipe: Pipeline, data: Encoded, rows: torch.Tensor, key: torch.Tensor) -> tuple:
    """``(latents, text_states, t, noise)`` of ``rows``: latents from their posteriors, then the
    timesteps and noise, each from its own part of ``key``."""
    k_lat, k_draw = random.split(key, 2)
    latents = pipe.vae.latents_from_moments(data.mean[rows], data.logvar[rows], k_lat)
    return (latents, data.text[rows], *draw(pipe.schedule, k_draw, latents))


def fine_tune(pipe: Pipeline, plan: Any, tx: Any, batches: Callable[[int], tuple], *, steps: int,
              out: str | None = None, save_every: int = 0, resume: bool = False, progress: bool = True,
              model: Any = None, params: Any = None, write: Callable[[Any, str], None] | None = None,
              key: torch.Tensor | None = None) -> tuple[Any, list[float]]:
    """``steps`` steps of ``plan`` over ``batches(step) -> batch`` training ``model`` (default the
    pipeline UNet's ``Denoiser``) from ``params`` (default the UNet's, as fp32 masters); ``(the trained
    params, the losses)``. With ``out``, ``write(params, out)`` saves them there at the end (and every
    ``save_every`` steps, with the train state; default: the pipeline, ``write_pipeline``); ``resume``
    continues from ``out``'s state. ``key``: step ``s`` draws its dropout from ``fold_in(key, s)``."""
    from tqdm.auto import tqdm
    model = model or Denoiser(pipe.unet, pipe.schedule)
    write = write or (lambda trained, directory: write_pipeline(pipe, trained, directory))
    if params is None:  # fp16 weights: fp32 masters
        params = tree_util.map(lambda x: x.float() if x.is_floating_point() else x, pipe.unet_params)
    plan.check(model)
    with plan.make_mesh() as mesh:
        program = plan.step(model, tx, mesh=mesh)
        state, start = program.init_from(params), 0
        if resume:
            state, meta = program.load(_state_dir(out), state)
            start = int(meta["step"])
        losses: list[float] = []

        def save(step: int, state: Any) -> None:
            program.save(os.path.join(out, STATE_DIR), state, metadata={"step": step})
            write(program.params(state), out)

        with tqdm(total=steps, initial=start, desc="training", unit="step", disable=not progress) as bar:
            for step in range(start, steps):
                state, metrics = program(state, batches(step), None if key is None else random.fold_in(key, step))
                losses.append(float(metrics["loss"]))
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
                bar.update(1)
                if out is not None and save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                    save(step + 1, state)
        params = program.params(state)
        if out is not None:
            save(steps, state)
    return params, losses


def _writes() -> bool:
    """Whether this process writes the outputs: process 0 where several run."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def write_lora(pipe: Pipeline, config: LoraConfig) -> Callable[[Any, str], None]:
    """``fine_tune``'s ``write`` for UNet adapters made with ``config``: diffusers' LoRA file
    (``cfx.lora.save_diffusers``), which ``load_lora_weights`` loads onto ``pipe``'s pipeline."""
    def write(adapters: Any, out: str) -> None:
        if _writes():
            save_diffusers(out, pipe, unet=(adapters, config))
    return write


def write_pipeline(pipe: Pipeline, unet_params: Any, out: str) -> None:
    """``pipe`` with ``unet_params`` in diffusers' layout in ``out``, its tokenizer copied (process 0
    writes where several run)."""
    if not _writes():
        return
    save_pipeline(out, dataclasses.replace(pipe, unet_params=unet_params))
    src = os.path.join(pipe.directory or "", "tokenizer")
    if pipe.directory and os.path.isdir(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out, "tokenizer")):
        shutil.copytree(src, os.path.join(out, "tokenizer"), dirs_exist_ok=True)


def _state_dir(out: str | None) -> str:
    path = os.path.join(out or "", STATE_DIR)
    if out is None or not os.path.isdir(path):
        raise ValueError(f"--resume: {path!r} holds no train state; run with --out DIR --save-every N first "
                         "(or drop --resume).")
    return path
