"""``python -m cfx.diffusion.sample --pipeline DIR --prompt "..." --steps 25 --out image.png``.

Text to image with a Stable Diffusion pipeline directory (diffusers' layout, its ``tokenizer/``
read with transformers' ``CLIPTokenizer``): DDIM with classifier-free guidance (``--guidance``,
against ``--negative-prompt``), a progress bar over the steps, the PNG written with Pillow;
``--int8`` quantizes the UNet's and text encoder's Linear and convolution weights to int8 (``cfx.quant``;
the VAE stays in floating point).
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cfx.diffusion.sample", description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", required=True, help="a Stable Diffusion pipeline directory (diffusers' layout)")
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
    a = p.parse_args(argv)
    from cfx._src.diffusion.data import write_png
    try:
        image = run(a)
        write_png(image, a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


def run(a: argparse.Namespace) -> torch.Tensor:
    import cfx
    from cfx._src.diffusion.pipeline import tokenizer
    from cfx._src.diffusion.sampling import sample, text_states
    pipe = cfx.diffusion.load_pipeline(a.pipeline)
    if a.int8:
        pipe.unet_params = cfx.quant.quantize(pipe.unet_params, "int8")
        pipe.text_params = cfx.quant.quantize(pipe.text_params, "int8")
    tokenize = tokenizer(a.pipeline, pipe.text_encoder.config.max_position_embeddings)
    cond, uncond = text_states(pipe, tokenize(a.prompt)), text_states(pipe, tokenize(a.negative_prompt))
    from tqdm.auto import tqdm
    with tqdm(total=a.steps, desc="sampling", unit="step", disable=a.no_progress) as bar:
        images = sample(pipe, cond, uncond, steps=a.steps, guidance_scale=a.guidance, key=cfx.random.key(a.seed),
                        height=a.height, width=a.width, progress=lambda i: bar.update(1))
    return images[0]


if __name__ == "__main__":
    sys.exit(main())
