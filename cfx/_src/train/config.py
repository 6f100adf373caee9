"""The training job's configuration and its command line."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "gpt2"            # gpt2 | llama | opt
    preset: str = "tiny"
    steps: int = 300
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"        # fp32 | bf16 | fp16
    seed: int = 0
    data: str | None = None        # a text file; default: the stdlib's source text
    eval_every: int = 50
    eval_batches: int = 8
    save: str | None = None        # checkpoint path (.safetensors), written at the end
    save_every: int = 0            # also every N steps when > 0
    resume: str | None = None      # checkpoint to continue from
    stop_after: int = 0            # stop (and save) after N steps of this run; 0 runs to --steps
    sample_bytes: int = 200        # bytes of text to sample from the trained model at the end
    remat: str = "none"            # none | blocks (nothing_saveable per block) | dots (dots_saveable) | auto
    remat_budget: str = "512MiB"   # activation budget of --remat auto (the Rotor solver's schedule)
    mesh: str | None = None        # e.g. "pipe=2,data=2,model=2": the axes of a cfx.parallel.Plan
    zero: int = 0                  # ZeRO stage over the data axis
    offload: str = "none"          # none | host | nvme | auto: Gemini placement of ZeRO-3 chunks
    offload_budget: str | None = None  # device budget of --offload auto (default: what is free)
    nvme_dir: str | None = None    # files of --offload nvme (default: a new temporary directory)
    schedule: str = "1f1b"         # pipeline schedule with a pipe axis: gpipe | 1f1b | interleaved | zb-h1
    microbatches: int = 4          # micro-batches per step with a pipe axis
    chunks: int = 2                # virtual stages per rank for --schedule interleaved
    sp: str | None = None          # ring | ulysses over a seq axis, megatron over model (None: ring with seq)
    auto: bool = False             # search the plan over --mesh with cfx.autoshard
    auto_budget: str | None = None # memory per rank for --auto's search (params, grads, moments, activations)
    threads: int = 0               # torch intra-op threads; 0 keeps torch's default
    progress: bool = True
    json: str | None = None        # write the summary as JSON here


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m cfx.train",
                                description="Train a cfx language model on byte-level text (CPU-friendly defaults).")
    p.add_argument("--model", choices=["gpt2", "llama", "opt"], default=d.model)
    p.add_argument("--preset", default=d.preset, help="model size preset, e.g. tiny, small (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length in bytes")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup + cosine decay)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global-norm clip; 0 disables")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=d.precision)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=d.data, help="a text file (default: the Python stdlib's source text)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--save", default=d.save,
                   help="checkpoint path: FILE.safetensors (gathered), or on a --mesh a DIR each process writes "
                        "its own blocks into (--resume DIR loads it onto another data / seq / model layout)")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--resume", default=d.resume, help="checkpoint to resume from")
    p.add_argument("--stop-after", type=int, default=d.stop_after,
                   help="stop and save after N steps of this run (resume later with --resume)")
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
                   help="where ZeRO-3's params and optimizer state live: host RAM (host; auto keeps "
                        "chunks on the device within --offload-budget) or files (nvme); needs --zero 3")
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
    p.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads (0: default)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--json", default=d.json, help="write the final summary as JSON to this path")
    a = p.parse_args(argv)
    cfg = TrainConfig(**vars(a))
    for name in ("steps", "batch", "seq"):
        if getattr(cfg, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(cfg, name)}")
    given = {action.dest for action in p._actions for arg in (sys.argv[1:] if argv is None else argv)
             if any(arg == o or arg.startswith(o + "=") for o in action.option_strings)}
    try:
        check_flags(cfg, given)
    except ValueError as e:
        p.error(str(e))
    return cfg


def check_flags(cfg: TrainConfig, given: set[str] = frozenset()) -> None:
    """ValueError naming a flag that would be silently ignored with the others given: one that
    was ``given`` on the command line, or a config field set away from its default."""
    d = TrainConfig()
    set_ = {f.name for f in dataclasses.fields(cfg) if f.name in given or getattr(cfg, f.name) != getattr(d, f.name)}
    axes = {part.partition("=")[0].strip() for part in (cfg.mesh or "").split(",") if part}
    rules = [
        (("schedule", "microbatches", "chunks"), "pipe" not in axes,
         "applies to a pipeline: add pipe=N to --mesh (e.g. --mesh pipe=2)"),
        (("chunks",), cfg.schedule != "interleaved", "applies to --schedule interleaved only"),
        (("remat_budget",), cfg.remat != "auto", "applies to --remat auto only (blocks and dots keep a fixed set)"),
        (("zero",), not cfg.mesh, "needs a mesh with a data axis: add --mesh data=N"),
        (("offload",), not cfg.mesh, "needs --mesh data=N --zero 3"),
        (("offload_budget",), cfg.offload != "auto", "applies to --offload auto only"),
        (("nvme_dir",), cfg.offload != "nvme", "applies to --offload nvme only"),
        (("sp",), not cfg.mesh, "needs a mesh: --mesh seq=N (ring, ulysses) or --mesh model=N (megatron)"),
        (("save_every",), not cfg.save, "needs --save PATH (where to write the checkpoints)"),
    ]
    if cfg.auto:
        if not cfg.mesh:
            raise ValueError("--auto searches a plan over a mesh: add --mesh, e.g. --mesh data=2,model=2.")
        if axes - {"data", "model"}:
            raise ValueError(f"--auto lays ops out over data and model axes; {sorted(axes - {'data', 'model'})} "
                             "in --mesh are schedules (pipeline, sequence parallelism): use them without --auto.")
        decided = [n for n in ("zero", "offload", "offload_budget", "remat", "remat_budget", "sp", "nvme_dir")
                   if n in set_]
        if decided:
            raise ValueError(f"--{decided[0].replace('_', '-')} is decided by --auto's search (params split over "
                             "data are ZeRO-3's layout); drop it, or drop --auto.")
        if cfg.precision != "fp32":
            raise ValueError("--auto searches an fp32 step; drop --precision or drop --auto.")
        if cfg.save and not cfg.save.endswith(".safetensors") or cfg.resume and not cfg.resume.endswith(
                ".safetensors"):
            raise ValueError("--auto saves and resumes one .safetensors file (gathered): give --save / --resume "
                             "PATH.safetensors.")
    rules.append((("auto_budget",), not cfg.auto, "applies to --auto only"))
    for names, ignored, why in rules:
        for name in names:
            if ignored and name in set_:
                raise ValueError(f"--{name.replace('_', '-')} {why}; as given it would be ignored.")

