"""``python -m cfx.train``: train a language model on byte-level text (CPU-friendly defaults).

    python -m cfx.train --model gpt2 --preset tiny --steps 300 --precision bf16
    python -m cfx.train --mesh pipe=2,data=2,model=2 --zero 1 --remat blocks --save run/
    python -m cfx.train --mesh data=2,row=2,col=2 --tp 2d --zero 1
    python -m cfx.train --lora r=8,alpha=16,targets=attn --lora-base int8 --init-from run/ --mesh model=2
    python -m cfx.train --lora r=8,alpha=16,targets=attn --init-from hf_llama/ --save-peft adapter/

The flags are ``TrainConfig``'s fields; one that the others would make ignored is refused here,
before anything runs (``check_flags``). The run shows a progress bar and prints its summary.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from cfx._src.core.runtime import keep_host_memory
from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.models.families import trained
from cfx._src.plan.config import PRECISIONS
from cfx._src.train.config import TrainConfig, check_flags
from cfx._src.train.loop import train


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = command_parser("python -m cfx.train", "Train a cfx language model on byte-level text (CPU-friendly defaults).")
    p.add_argument("--model", choices=trained(), default=d.model)
    p.add_argument("--preset", default=d.preset, help="model size preset, e.g. tiny, small; fields after commas "
                   "override it, e.g. tiny,n_layer=4 (mixtral under --mesh pipe=N: tiny,router_aux_group_size=128)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length in bytes")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup + cosine decay)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global-norm clip; 0 disables")
    p.add_argument("--fp8-comm", default=d.fp8_comm, metavar="PARTS",
                   help="with an fp8 --precision: all_gather (ZeRO-3's float8 weights gathered as e4m3), "
                        "reduce_scatter (ZeRO-3's gradients as e5m2), pipe (stages' activations as e4m3), joined "
                        "by +; none: off")
    p.add_argument("--precision", choices=list(PRECISIONS), default=d.precision,
                   help="fp8[:recipe]: bf16 with the blocks' Linear matmuls in float8 (but the first block's); "
                        "fp8:delayed: tensorwise, scaled from earlier steps' amaxes (Transformer Engine's)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=d.data, help="a text file (default: the Python stdlib's source text)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    _checkpoint_flags(p, d)
    _lora_flags(p, d)
    _grid_flags(p, d)
    p.add_argument("--sample-bytes", type=int, default=d.sample_bytes,
                   help="sample this many bytes of text at the end (0: none)")
    p.add_argument("--remat", choices=["none", "blocks", "dots", "auto"], default=d.remat,
                   help="activation checkpointing per block: blocks keeps only each block's input, "
                        "dots also keeps matmul outputs, auto solves the fastest schedule whose "
                        "activations fit --remat-budget (Rotor)")
    p.add_argument("--remat-budget", default=d.remat_budget,
                   help="activation memory budget for --remat auto, e.g. 512MiB, 1.5GB")
    p.add_argument("--mesh", default=d.mesh,
                   help="train on a mesh, e.g. pipe=2,data=2,model=2 (local threads, or one process per "
                        "rank under torchrun); with the strategy flags it is a cfx.parallel.Plan")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=d.zero,
                   help="ZeRO stage over the data axis of --mesh (1: optimizer state, 2: + gradients, 3: + params)")
    p.add_argument("--offload", choices=["none", "host", "nvme", "auto"], default=d.offload,
                   help="where ZeRO-3's params and optimizer state (and --lora's frozen base) live: host RAM (host; "
                        "auto keeps chunks on the device within --offload-budget) or files (nvme); needs --zero 3")
    p.add_argument("--offload-budget", default=d.offload_budget,
                   help="device memory budget of --offload auto, e.g. 64MiB")
    p.add_argument("--nvme-dir", default=d.nvme_dir,
                   help="directory for --offload nvme's files (default: a new temporary directory)")
    p.add_argument("--schedule", default=d.schedule, choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
                   help="pipeline schedule when --mesh has a pipe axis")
    p.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="micro-batches per step when --mesh has a pipe axis")
    p.add_argument("--chunks", type=int, default=d.chunks,
                   help="virtual stages per pipe rank for --schedule interleaved")
    p.add_argument("--sp", choices=["ring", "ulysses", "megatron"], default=d.sp,
                   help="sequence parallelism: ring (the default with a seq axis in --mesh) or ulysses attention "
                        "over seq, or megatron (Megatron-SP) over the model axis")
    p.add_argument("--auto", action="store_true",
                   help="let cfx.autoshard search how every op splits over --mesh (fastest plan under its cost "
                        "model; prints the plan and how it compares with Megatron's)")
    p.add_argument("--auto-budget", default=d.auto_budget,
                   help="memory per rank the --auto plan must fit, e.g. 2GiB (params, grads, AdamW moments, saved "
                        "activations)")
    p.add_argument("--verbose", action="store_true",
                   help="with --auto: print every param's spec and the plan's collectives, not only its summary")
    p.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads (0: default)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--json", default=d.json, help="write the final summary as JSON to this path")
    a = parse(p, argv)
    cfg = TrainConfig(**vars(a))
    given = {action.dest for action in p._actions for arg in (sys.argv[1:] if argv is None else argv)
             if any(arg == o or arg.startswith(o + "=") for o in action.option_strings)}
    try:
        check_flags(cfg, given)
    except ValueError as e:
        p.error(str(e))
    return cfg


def _checkpoint_flags(p, d: TrainConfig) -> None:
    """Where checkpoints go, when, how a run continues from one, and the per-step log."""
    p.add_argument("--save", default=d.save,
                   help="checkpoint path: FILE.safetensors (whole tensors), or on a --mesh a DIR each process "
                        "writes its own blocks into; either resumes under any --mesh and strategy, or none")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: the loop waits only for the copy to host memory "
                        "(one save in flight; the next waits for it; a kill mid-write keeps the previous one)")
    p.add_argument("--resume", default=d.resume,
                   help="checkpoint to resume from: any run's (one device, any --mesh and strategy, --auto); "
                        "'auto': --save's newest committed checkpoint if there is one, else step 0 (for "
                        "torchrun --max-restarts: a restarted job continues where it was saved)")
    p.add_argument("--metrics", default=d.metrics,
                   help="append every step's train loss (and each eval) to this file as JSON lines")
    p.add_argument("--log", default=d.log, metavar="tensorboard:DIR",
                   help="also write the train and eval losses and tokens/s as TensorBoard scalars into DIR "
                        "(pip install 'cfx[tensorboard]'; view with: tensorboard --logdir DIR)")
    p.add_argument("--plot", default=d.plot,
                   help="at the end, draw this run's train and eval loss curves into this PNG file (matplotlib)")
    p.add_argument("--stop-after", type=int, default=d.stop_after,
                   help="stop and save after N steps of this run (resume later with --resume)")


def _grid_flags(p, d: TrainConfig) -> None:
    """2D / 2.5D / 3D tensor parallelism over the mesh's ``row``, ``col`` (and ``dep``) axes."""
    p.add_argument("--tp", choices=["2d", "2.5d", "3d"], default=d.tp,
                   help="split every block over a grid of --mesh axes: 2d over row x col (Optimus), 2.5d over "
                        "row x col x dep (Tesseract), 3d over a row = col = dep cube; e.g. --mesh "
                        "data=2,row=2,col=2 --tp 2d")


def _lora_flags(p, d: TrainConfig) -> None:
    """Fine-tuning LoRA adapters over a frozen base (``cfx.lora``)."""
    p.add_argument("--lora", default=d.lora,
                   help="train LoRA adapters over a frozen base instead of every param, e.g. r=8,alpha=16,targets=attn "
                        "(keys r, alpha, targets: presets attn, qkv, mlp, all-linear or patterns joined by +, and rslora); "
                        "checkpoints hold the adapters and their optimizer state")
    p.add_argument("--lora-base", choices=["fp32", "bf16", "fp16", "int8"], default=d.lora_base,
                   help="how --lora's frozen base is stored: int8 Linear weights (QLoRA's recipe), or --precision's "
                        "dtype (the default)")
    p.add_argument("--init-from", default=d.init_from,
                   help="start from these weights: a Hugging Face model directory or a python -m cfx.train checkpoint; "
                        "alone a full fine-tune, with --lora the frozen base (default: the model --model / --preset / "
                        "--seed initialise); --resume needs it again")
    p.add_argument("--tokenizer", default=d.tokenizer,
                   help="a Hugging Face tokenizer directory (often --init-from's own): --data (a text file, or a "
                        "directory of *.txt documents) read as its tokens, documents joined by its end-of-text token; "
                        "default: bytes")
    p.add_argument("--pad-vocab", default=d.pad_vocab, metavar="auto|N",
                   help="pad the vocabulary to a multiple of N, the padded ids masked (the same loss and tokens): auto "
                        "pads only what a --mesh model axis cannot split (GPT-2's 50257 on model=2: 50304); "
                        "--save-hf writes the real vocabulary")
    p.add_argument("--save-hf", default=d.save_hf,
                   help="at the end, write the trained model (and --tokenizer) to this directory as a Hugging Face "
                        "model directory that transformers' from_pretrained and python -m cfx.generate load")
    p.add_argument("--save-peft", default=d.save_peft,
                   help="at the end, write --lora's trained adapters to this directory as peft's adapter_config.json + "
                        "adapter_model.safetensors, which peft.PeftModel.from_pretrained(the base's transformers model, "
                        "DIR) loads (GPT-2, Llama, OPT; GPT-2's fused c_attn needs shared_a=q+k+v in --lora); on a "
                        "--mesh the adapters are gathered and process 0 writes")


def run(cfg: TrainConfig) -> dict[str, Any]:
    """The run ``cfg`` describes; its summary."""
    keep_host_memory()  # reuse freed pages across steps (see cfx._src.core.runtime)
    return train(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv)
