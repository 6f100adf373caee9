"""``python -m cfx.diffusion.dreambooth --pipeline DIR --instance-dir DIR --instance-prompt P --class-prompt P --out DIR``.

DreamBooth: fine-tunes a Stable Diffusion pipeline's UNet on a few images of one subject
(``--instance-dir``, no captions: every image is ``--instance-prompt``) with prior preservation, as
diffusers' ``train_dreambooth.py``: first the BASE pipeline draws ``--num-class-images`` images of
``--class-prompt`` into ``--class-dir`` (default ``OUT/class_images``; ``--sample-steps`` DDIM steps
at ``--guidance``, a progress bar; images already there are reused), the size of the instance
images; then each step trains on ``--batch-size`` instance rows and as many class rows, minimising
``mse(instance) + --prior-loss-weight x mse(class)`` (``--prior-loss-weight 0``: no class images,
plain fine-tuning). The rest is ``python -m cfx.diffusion.train``'s: AdamW under a
``cfx.parallel.Plan`` (``--mesh data=N`` ranks -- the ``2 x --batch-size`` rows must split over
them -- ``--zero``, ``--offload``, ``--remat``, ``--precision``), the frozen VAE and text encoder
encoding the images once, a progress bar with the loss, and the fine-tuned pipeline (diffusers'
layout) written to ``--out`` (with ``--save-every N``, every N steps with the state ``--resume``
continues). ``--lora r=4,alpha=4`` trains LoRA adapters of the frozen UNet instead (diffusers'
``train_dreambooth_lora.py``; ``targets=`` presets or patterns joined by ``+``, default ``unet-attn``:
every attention's to_q, to_k, to_v and to_out; ``--lora-base bf16|int8`` for the frozen weights) and
writes them to ``--out`` as diffusers' ``pytorch_lora_weights.safetensors``, which
``StableDiffusionPipeline.load_lora_weights(OUT)`` loads.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.diffusion import dreambooth
from cfx._src.diffusion.cli_train import arguments, optimizer, plan_of, report
from cfx._src.diffusion.finetune import encode, fine_tune, write_lora
from cfx._src.diffusion.lora import WEIGHTS
from cfx._src.diffusion.pipeline import load_pipeline, tokenizer
from cfx._src.diffusion.sampling import latent_shape
from cfx._src.diffusion.train import BASES, lora_denoiser, unet_base
from cfx._src.core.cli import parse, run_command
from cfx._src.lora.adapters import init as lora_init
from cfx._src.lora.config import LoraConfig


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arguments(__doc__.splitlines()[0], prog="python -m cfx.diffusion.dreambooth")
    p.add_argument("--instance-dir", required=True, help="images of the subject (no captions needed)")
    p.add_argument("--instance-prompt", required=True, help='the caption of every instance image ("a sks dog")')
    p.add_argument("--class-prompt", required=True, help='what the base pipeline draws the prior from ("a dog")')
    p.add_argument("--class-dir", default=None,
                   help="the class images, drawn where missing (default: OUT/class_images)")
    p.add_argument("--num-class-images", type=int, default=8)
    p.add_argument("--prior-loss-weight", type=float, default=1.0, help="0: no prior, plain fine-tuning")
    p.add_argument("--sample-steps", type=int, default=25, help="DDIM steps per class image")
    p.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale of the class images")
    p.add_argument("--lora", default=None, metavar="r=R,alpha=A[,targets=T+T][,dropout=D][,rslora=1]",
                   help="train LoRA adapters of the frozen UNet (targets: cfx.lora presets or path patterns, default "
                        "unet-attn) and write diffusers' pytorch_lora_weights.safetensors to --out")
    p.add_argument("--lora-base", choices=list(BASES), default="fp32",
                   help="with --lora: the frozen UNet's weights (int8: weight-only, per output channel)")
    return parse(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv, report=lambda a, out: report(a, *out))


def run(a: argparse.Namespace) -> tuple[list[float], str]:
    """``(the losses, a note on the class images)`` of the run the flags describe (module doc)."""
    plan = plan_of(a)
    config = lora_config(a, plan)
    if not a.prior_loss_weight >= 0:
        raise ValueError(f"--prior-loss-weight {a.prior_loss_weight}: must be at least 0 (0 trains on the instance "
                         "images alone).")
    prior = a.prior_loss_weight > 0
    if prior and (a.num_class_images < 1 or a.sample_steps < 1):
        raise ValueError("--num-class-images and --sample-steps must be at least 1 (or --prior-loss-weight 0: no "
                         "class images).")
    images = dreambooth.read_images("--instance-dir", a.instance_dir, resolution=a.resolution)  # (N, 3, H, W)
    pipe = load_pipeline(a.pipeline)
    tokenize = tokenizer(a.pipeline, pipe.text_encoder.config.max_position_embeddings)
    H, W = images.shape[2:]
    try:
        latent_shape(pipe, 1, H, W)
    except ValueError as e:
        why = e.args[0].removeprefix("sample: ")
        raise ValueError(f"--instance-dir {a.instance_dir!r}: its images are {H}x{W} pixels; {why} Give --resolution N "
                         "to resize and center-crop them.") from None
    k_class, k_train = random.split(random.key(a.seed), 2)
    klass, note = None, ""
    if prior:
        class_dir = a.class_dir or os.path.join(a.out, "class_images")
        klass, drawn = dreambooth.class_data(
            pipe, tokenize, a.class_prompt, class_dir, a.num_class_images, size=(H, W), resolution=a.resolution,
            steps=a.sample_steps, guidance_scale=a.guidance, key=k_class, progress=not a.no_progress)
        note = f"; {len(klass)} class images in {class_dir} ({drawn} drawn)"
    instance = encode(pipe, images, tokenize([a.instance_prompt] * len(images)))
    batches = dreambooth.batches(pipe, instance, klass, batch_size=a.batch_size, prior_loss_weight=a.prior_loss_weight,
                                 key=k_train)
    lora = lora_run(a, pipe, config, k_train) if config is not None else {}
    trained, losses = fine_tune(pipe, plan, optimizer(a), batches, steps=a.steps, out=a.out, save_every=a.save_every,
                                resume=a.resume, progress=not a.no_progress, **lora)
    if config is not None:
        note += f"; LoRA adapters ({tree_util.size(trained):,} params) in {os.path.join(a.out, WEIGHTS)}"
    return losses, note


def lora_config(a: argparse.Namespace, plan: Any) -> LoraConfig | None:
    """``--lora``'s config (None without it); ValueErrors for the flags it does not go with."""
    if a.lora is None:
        if a.lora_base != "fp32":
            raise ValueError(f"--lora-base {a.lora_base} is the frozen UNet of LoRA training; add --lora r=R,alpha=A.")
        return None
    config = LoraConfig.parse(a.lora, targets=("unet-attn",))
    if plan.has("model"):
        raise ValueError(f"--mesh {a.mesh}: --lora trains over data ranks (the adapters are small); drop model=.")
    if a.precision != "fp32":
        raise ValueError(f"--precision {a.precision} casts the trained weights; --lora trains fp32 adapters beside "
                         "the frozen UNet: give --lora-base bf16 for a bf16 UNet instead.")
    return config


def lora_run(a: argparse.Namespace, pipe: Any, config: LoraConfig, key: Any) -> dict:
    """``fine_tune``'s arguments training ``config``'s adapters of ``pipe``'s UNet (``--lora-base``
    frozen), drawn from ``fold_in(key, 1)`` (dropout from ``fold_in(key, 2)``), saved as diffusers' file."""
    adapters = lora_init(pipe.unet, config, random.fold_in(key, 1))
    model = lora_denoiser(pipe.unet, pipe.schedule, unet_base(pipe.unet, pipe.unet_params, a.lora_base), config,
                          adapters)
    return {"model": model, "params": adapters, "write": write_lora(pipe, config),
            "key": random.fold_in(key, 2) if config.dropout else None}
