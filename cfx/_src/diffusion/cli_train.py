"""``python -m cfx.diffusion.train --pipeline DIR --data DIR_OF_IMAGES_WITH_CAPTIONS --out DIR``.

Fine-tunes a Stable Diffusion pipeline's UNet on captioned images (``metadata.jsonl``, or a ``.txt``
caption beside each image; ``--resolution N`` resizes and center-crops them) with AdamW under a
``cfx.parallel.Plan``: ``--mesh data=2`` ranks (``data=2,model=2``: tensor parallel too),
``--zero 0-3``, ``--offload host|nvme|auto`` (with ZeRO-3), ``--remat blocks|dots`` per resnet /
transformer, ``--precision bf16``; attention runs
through ``cfx.nn.attention`` (flash kernels). The VAE and text encoder stay frozen and encode the
data once. A progress bar shows the loss; ``--out`` receives the pipeline (diffusers' layout) at the
end and, with ``--save-every N``, every N steps with the train state, which ``--resume`` continues.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from cfx._src.core import random
from cfx._src.diffusion.data import load_images
from cfx._src.diffusion.finetune import batch_at, encode, fine_tune, rows_of
from cfx._src.diffusion.pipeline import load_pipeline, tokenizer
from cfx._src.optim.alias import adamw
from cfx._src.optim.loss_scale import dynamic_loss_scale
from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.plan.config import parse_mesh
from cfx._src.plan.plan import Plan
from cfx._src.precision.amp import policy

MESH_FIX = ("; a UNet trains over data ranks and tensor-parallel model ranks (--mesh data=N or data=N,model=M); "
            "shard its state with --zero 3 (and --offload).")


def arguments(description: str, *, prog: str) -> argparse.ArgumentParser:
    """The flags ``train`` and ``dreambooth`` share: the pipeline, the output, the plan, AdamW."""
    p = command_parser(prog, description)
    p.add_argument("--pipeline", required=True, help="a Stable Diffusion pipeline directory (diffusers' layout)")
    p.add_argument("--out", required=True, help="where the fine-tuned pipeline (and --save-every's state) goes")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4, help="rows per step, over all data ranks")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--resolution", type=int, default=None,
                   help="resize (shorter side) and center-crop every image to N x N pixels")
    p.add_argument("--mesh", default="data=1",
                   help="data=N[,model=M]: ranks (threads here, processes under torchrun); model splits each "
                        "resnet's channels and each transformer's heads (Megatron)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--offload", choices=["none", "host", "nvme", "auto"], default="none",
                   help="with --zero 3: where the params' pieces and the optimizer state live")
    p.add_argument("--remat", choices=["none", "blocks", "dots"], default="none",
                   help="recompute each resnet / transformer in backward (dots: keep its matmuls' outputs)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out's saved train state")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arguments(__doc__.splitlines()[0], prog="python -m cfx.diffusion.train")
    p.add_argument("--data", required=True, help="images with captions (metadata.jsonl, or NAME.txt beside NAME.png)")
    return parse(p, argv)


def plan_of(a: argparse.Namespace) -> Plan:
    """The ``cfx.parallel.Plan`` the flags name (ValueError naming the flag otherwise)."""
    mesh = parse_mesh(a.mesh, axes=("data", "model"), fix=MESH_FIX)
    if a.offload != "none" and a.zero != 3:
        raise ValueError(f"--offload {a.offload} moves ZeRO-3's pieces; add --zero 3.")
    if a.batch_size < 1 or a.steps < 1:
        raise ValueError("--batch-size and --steps must be at least 1.")
    return Plan(mesh=mesh, zero=a.zero, offload=a.offload, remat=a.remat, precision=a.precision)


def optimizer(a: argparse.Namespace) -> Any:
    """AdamW at ``--lr`` (dynamic loss scaling around it under ``--precision fp16``)."""
    tx = adamw(a.lr, weight_decay=a.weight_decay)
    return dynamic_loss_scale(tx) if policy(a.precision).needs_loss_scaling else tx


def run(a: argparse.Namespace) -> list[float]:
    """The losses of the run the flags describe (module doc)."""
    plan = plan_of(a)
    pipe = load_pipeline(a.pipeline)
    tokenize = tokenizer(a.pipeline, pipe.text_encoder.config.max_position_embeddings)
    images, texts, _ = load_images(a.data, resolution=a.resolution, captions=True)
    data = encode(pipe, images, tokenize(texts))
    k_rows, k_steps = random.split(random.key(a.seed), 2)

    def batches(step: int) -> tuple:
        return batch_at(pipe, data, rows_of(len(data), a.batch_size, step, k_rows), random.fold_in(k_steps, step))
    _, losses = fine_tune(pipe, plan, optimizer(a), batches, steps=a.steps, out=a.out, save_every=a.save_every,
                          resume=a.resume, progress=not a.no_progress)
    return losses


def report(a: argparse.Namespace, losses: list[float], note: str = "") -> None:
    """The line a fine-tuning command ends with: where the pipeline went, and the loss's first and last."""
    print(f"{a.out}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}{note}" if losses else a.out)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv, report=report)
