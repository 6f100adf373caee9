"""``python -m cfx.diffusion.sample --pipeline DIR --prompt "..." --steps 25 --out image.png``.

Text to image with a Stable Diffusion pipeline directory (diffusers' layout, its ``tokenizer/``
read with transformers' ``CLIPTokenizer``): DDIM with classifier-free guidance (``--guidance``,
against ``--negative-prompt``), a progress bar over the steps, the PNG written with Pillow;
``--int8`` quantizes the UNet's and text encoder's Linear and convolution weights to int8 (``cfx.quant``;
the VAE stays in floating point).
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from tqdm.auto import tqdm

from cfx._src.core import random
from cfx._src.diffusion.data import write_png
from cfx._src.diffusion.pipeline import load_pipeline, tokenizer
from cfx._src.diffusion.sampling import sample, text_states
from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.precision.quant import quantize


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = command_parser("python -m cfx.diffusion.sample", __doc__.splitlines()[0])
    p.add_argument("--pipeline", required=True, help="a Stable Diffusion pipeline directory (diffusers' layout, with "
                   "tokenizer/); cfx.diffusion.tiny_pipeline(DIR) writes a tiny random one to try")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="", help="what guidance steers away from (default: empty)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale (1: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--height", type=int, default=None, help="pixels (default: the UNet's sample size x 8)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--out", default="image.png")
    p.add_argument("--int8", action="store_true",
                   help="int8 weight-only Linear and convolution layers in the UNet and text encoder (cfx.quant; "
                        "the VAE stays in floating point)")
    p.add_argument("--no-progress", action="store_true")
    return parse(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv, report=lambda a, out: print(out))


def run(a: argparse.Namespace) -> str:
    """Draws the image the flags describe and writes it to ``--out``; returns that path."""
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--out {a.out!r}: the directory {folder!r} does not exist or is not writable; create it "
                         "first, or write the image elsewhere (checked before sampling).")
    pipe = load_pipeline(a.pipeline)
    if a.int8:
        pipe.unet_params = quantize(pipe.unet_params, "int8", axes=pipe.unet.axes())
        pipe.text_params = quantize(pipe.text_params, "int8", axes=pipe.text_encoder.axes())
    tokenize = tokenizer(a.pipeline, pipe.text_encoder.config.max_position_embeddings)
    cond, uncond = text_states(pipe, tokenize(a.prompt)), text_states(pipe, tokenize(a.negative_prompt))
    with tqdm(total=a.steps, desc="sampling", unit="step", disable=a.no_progress) as bar:
        images = sample(pipe, cond, uncond, steps=a.steps, guidance_scale=a.guidance, key=random.key(a.seed),
                        height=a.height, width=a.width, progress=lambda i: bar.update(1))
    write_png(images[0], a.out)
    return a.out
