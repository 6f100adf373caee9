"""The training job's configuration: ``TrainConfig``, the checks of its fields against each other,
and the ``cfx.parallel.Plan`` it names (``python -m cfx.train``'s flags are its fields, ``cli_train``)."""
from __future__ import annotations

import dataclasses
import math
import os

from cfx._src.lora.config import LoraConfig
from cfx._src.plan.config import parse_mesh
from cfx._src.plan.plan import Plan

MESH_FIX = ", e.g. --mesh pipe=2,data=2,model=2; the strategy has its own flags (--zero, --remat, ...)."


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "gpt2"            # a family the job trains (cfx._src.models.families.trained())
    preset: str = "tiny"
    steps: int = 300
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"        # fp32 | bf16 | fp16 | fp8[:recipe]
    seed: int = 0
    data: str | None = None        # a text file; default: the stdlib's source text
    eval_every: int = 50
    eval_batches: int = 8
    save: str | None = None        # checkpoint path (.safetensors), written at the end
    save_every: int = 0            # also every N steps when > 0
    async_save: bool = False       # write checkpoints on a background thread (the loop waits for the host copy)
    resume: str | None = None      # checkpoint to continue from; "auto": --save's newest, if any
    metrics: str | None = None     # append every step's losses here as JSON lines (process 0)
    log: str | None = None         # "tensorboard:DIR": the losses and throughput as TensorBoard scalars (process 0)
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
    tp: str | None = None          # 2d | 2.5d | 3d: grid tensor parallelism over the mesh's row, col (, dep) axes
    fp8_comm: str = "none"         # all_gather, reduce_scatter, pipe (joined by +): float8 communication
    auto: bool = False             # search the plan over --mesh with cfx.autoshard
    auto_budget: str | None = None # memory per rank for --auto's search (params, grads, moments, activations)
    verbose: bool = False          # --auto: print every param's spec and the collectives too
    threads: int = 0               # torch intra-op threads; 0 keeps torch's default
    progress: bool = True
    json: str | None = None        # write the summary as JSON here
    lora: str | None = None        # e.g. "r=8,alpha=16,targets=attn": train LoRA adapters over a frozen base
    lora_base: str | None = None   # fp32 | bf16 | fp16 | int8: how the frozen base is stored (default: --precision's)
    init_from: str | None = None   # the frozen base: a Hugging Face directory or a cfx.train checkpoint
    save_peft: str | None = None   # write the trained adapters here at the end as a peft adapter directory
    tokenizer: str | None = None   # a Hugging Face tokenizer directory: --data read as its tokens, not bytes
    save_hf: str | None = None     # write the trained model here at the end as a Hugging Face model directory
    plot: str | None = None        # draw the train and eval loss curves into this PNG at the end
    pad_vocab: str | None = None   # "auto" or N: pad the vocabulary to a multiple of N (cfx.models.pad_vocab)


def check_flags(cfg: TrainConfig, given: set[str] = frozenset()) -> None:
    """ValueError naming a flag that would be silently ignored with the others given: one that
    was ``given`` on the command line, or a config field set away from its default."""
    _check_values(cfg)
    d = TrainConfig()
    set_ = {f.name for f in dataclasses.fields(cfg) if f.name in given or getattr(cfg, f.name) != getattr(d, f.name)}
    try:
        axes = {a for a, _ in parse_mesh(cfg.mesh, fix=MESH_FIX)} if cfg.mesh else set()
    except ValueError:  # a malformed --mesh: plan_of names it when the run starts
        return
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
        (("tp",), not axes & {"row", "col", "dep"}, "splits every block over the grid axes of --mesh: add "
         "row=N,col=N (2d) or row=N,col=N,dep=N (2.5d, 3d), e.g. --mesh data=2,row=2,col=2 --tp 2d"),
        (("save_every",), not cfg.save, "needs --save PATH (where to write the checkpoints)"),
        (("async_save",), not cfg.save, "needs --save PATH (where to write the checkpoints)"),
    ]
    if cfg.resume == "auto" and not cfg.save:
        raise ValueError("--resume auto continues from --save's newest checkpoint: add --save DIR (a restarted job "
                         "resumes from it, a first launch starts from step 0).")
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
        if cfg.save and not cfg.save.endswith(".safetensors"):  # (it resumes any checkpoint)
            raise ValueError("--auto saves one .safetensors file (gathered): give --save PATH.safetensors.")
    _check_lora(cfg, axes, set_)
    rules.append((("auto_budget",), not cfg.auto, "applies to --auto only"))
    rules.append((("verbose",), not cfg.auto, "prints --auto's whole plan; applies to --auto only"))
    for names, ignored, why in rules:
        for name in names:
            if ignored and name in set_:
                raise ValueError(f"--{name.replace('_', '-')} {why}; as given it would be ignored.")


def _check_values(cfg: TrainConfig) -> None:
    """ValueError naming a flag whose value no run can use (a negative learning rate trains uphill)."""
    positive = ("steps", "batch", "seq", "eval_batches", "microbatches", "chunks")
    at_least_0 = ("warmup", "weight_decay", "grad_clip", "eval_every", "save_every", "stop_after", "sample_bytes",
                  "threads")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be at least 1.")
    for name in at_least_0:
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be 0 or more.")
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ValueError(f"--lr {cfg.lr}: the peak learning rate must be a positive number (e.g. --lr 3e-4).")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio {cfg.min_lr_ratio}: the final learning rate's fraction of --lr must be in "
                         "[0, 1].")
    if cfg.pad_vocab is not None and cfg.pad_vocab != "auto" and not (
            str(cfg.pad_vocab).isdigit() and int(cfg.pad_vocab) >= 1):
        raise ValueError(f"--pad-vocab {cfg.pad_vocab}: give auto (the smallest padding a --mesh model axis splits) "
                         "or a positive multiple, e.g. --pad-vocab 128.")
    if cfg.nvme_dir is not None:
        parent = os.path.dirname(os.path.abspath(cfg.nvme_dir))
        if not os.path.isdir(parent):
            raise ValueError(f"--nvme-dir {cfg.nvme_dir}: its parent {parent} does not exist; create it, or give a "
                             "directory on the disk to stream to (one level is made, not a whole path).")


def _check_lora(cfg: TrainConfig, axes: set[str], set_: set[str]) -> None:
    """``--lora``, ``--lora-base`` and ``--init-from`` against each other and the rest (``check_flags``)."""
    if cfg.init_from and set_ & {"model", "preset"}:
        raise ValueError("--init-from gives the model (its config); drop --model / --preset.")
    if not cfg.lora:  # (--init-from alone: a full fine-tune of its weights)
        for name in ("lora_base", "save_peft"):
            if name in set_:
                what = "writes the adapters" if name == "save_peft" else "sets up the frozen base"
                raise ValueError(f"--{name.replace('_', '-')} {what} of --lora; add --lora (e.g. "
                                 "--lora r=8,alpha=16,targets=attn), or drop it.")
        return
    if cfg.save_hf:
        raise ValueError("--save-hf writes a whole model; under --lora, --save-peft writes the trained adapters.")
    config = LoraConfig.parse(cfg.lora)  # a ValueError naming --lora and the fix
    if cfg.lora_base not in (None, "int8", cfg.precision):
        raise ValueError(f"--lora-base {cfg.lora_base}: the frozen base computes beside the adapters in --precision's "
                         f"dtype ({cfg.precision}); use --precision {cfg.lora_base} (the adapters keep fp32 master "
                         f"copies), or --lora-base {cfg.precision} or int8.")
    refused = [(cfg.auto, "--auto searches a plan for every param; drop --auto (a --mesh with --zero trains the "
                          "adapters)"),
               (cfg.remat == "auto", "--remat auto solves a schedule over the model's own blocks; use --remat blocks "
                                     "or dots"),
               ("seq" in axes or cfg.sp is not None, "sequence parallelism is not wired for adapters; drop the seq "
                                                     "axis and --sp"),
               (cfg.tp is not None, "--tp's grid blocks split plain weights, not adapters over a frozen base; drop "
                                    "--tp and its row, col, dep axes (--mesh model=N splits adapters)"),
               (bool(config.dropout), "adapter dropout is not wired through the model's blocks (they get keys for "
                                      "the model's own dropout only); use dropout=0")]
    for bad, why in refused:
        if bad:
            raise ValueError(f"--lora: {why}.")


def plan_of(cfg: TrainConfig) -> Plan:
    """The ``cfx.parallel.Plan`` the flags name (``--mesh`` and the strategy flags); without
    ``--mesh`` the trivial one, a single device (``--auto`` searches its own over the plan's mesh)."""
    mesh = parse_mesh(cfg.mesh, fix=MESH_FIX) if cfg.mesh else ()
    pipe = {} if "pipe" not in dict(mesh) else dict(
        schedule=cfg.schedule, microbatches=cfg.microbatches,
        chunks=cfg.chunks if cfg.schedule == "interleaved" else 1)
    return Plan(mesh=mesh, zero=cfg.zero, offload=cfg.offload,
                offload_budget=cfg.offload_budget if cfg.offload == "auto" else None, remat=cfg.remat,
                remat_budget=cfg.remat_budget if cfg.remat == "auto" else None, precision=cfg.precision,
                sp=cfg.sp, tp=cfg.tp, fp8_comm=cfg.fp8_comm, **pipe)
