"""The training job: a language model on byte-level text, with eval, checkpoints and a summary."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Mapping

import torch
from tqdm.auto import tqdm

from cfx import amp, checkpoint, models, optim
from cfx._src.train import data as data_lib
from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.spmd.arrays import device_get
from cfx._src.core.tree import is_axes_leaf
from cfx._src.remat.plan import solve as solve_chain
from cfx._src.transforms.shapes import ShapeDtype, eval_shape
from cfx._src.core.text import format_table
from cfx._src.train.config import TrainConfig, check_flags
from cfx._src.models.sample import sample_bytes
from cfx._src.plan.config import AXES
from cfx._src.plan.plan import Plan
from cfx._src.plan.build import remat_blocks
from cfx._src.train.step import scaled_loss_grad


def build_model(cfg: TrainConfig):
    overrides = {"vocab_size": data_lib.VOCAB_SIZE}
    if cfg.model == "gpt2":
        model = models.gpt2(cfg.preset, **overrides)
        max_len = model.config.n_positions
    else:
        model = (models.llama if cfg.model == "llama" else models.opt)(cfg.preset, **overrides)
        max_len = model.config.max_position_embeddings
    if cfg.seq > max_len:
        raise ValueError(f"--seq {cfg.seq} exceeds the {cfg.model} {cfg.preset!r} context of {max_len}; "
                         f"use --seq {max_len} or less.")
    return model


def with_remat(model, mode: str, *, plan=None):
    """One device's activation checkpointing: per block (``remat_blocks``), or the blocks run as
    one chain under ``plan`` (``--remat auto``, from :func:`solve_remat`)."""
    if mode == "auto":
        return dataclasses.replace(model, remat_plan=plan)
    return remat_blocks(model, mode)


def solve_remat(cfg: TrainConfig, model, params, tokens: torch.Tensor, key, *, quiet: bool):
    """The Rotor plan for ``--remat auto`` on one device: the fastest schedule under
    ``--remat-budget`` (a mesh run's Plan solves its own on the first batch)."""
    params = tree_util.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                           if isinstance(x, ShapeDtype) else x, params)  # shapes are all it needs
    _, plan = solve_chain(model, params, tokens, budget=cfg.remat_budget, key=key)  # key: dropout too
    show_remat_plan(plan, quiet=quiet)
    return plan


def show_remat_plan(plan, *, quiet: bool) -> None:
    if plan is not None and not quiet:
        tqdm.write(str(format_table(plan.summary(), ["remat plan", "value"])))


def sharded_save(path: str) -> bool:
    """On a mesh, ``--save DIR`` (no ``.safetensors`` suffix) writes a sharded checkpoint directory;
    ``--save FILE.safetensors`` one file of gathered tensors."""
    return not path.endswith(".safetensors")


def plan_of(cfg: TrainConfig) -> Plan:
    """The ``cfx.parallel.Plan`` the flags name (``--mesh`` and the strategy flags)."""
    mesh = []
    for part in cfg.mesh.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in AXES or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {cfg.mesh!r}: expected comma-separated AXIS=SIZE with AXIS in {AXES}, e.g. "
                             "--mesh pipe=2,data=2,model=2; the strategy has its own flags (--zero, --remat, ...).")
        mesh.append((name.strip(), int(size)))
    pipe = {} if "pipe" not in dict(mesh) else dict(
        schedule=cfg.schedule, microbatches=cfg.microbatches,
        chunks=cfg.chunks if cfg.schedule == "interleaved" else 1)
    return Plan(mesh=tuple(mesh), zero=cfg.zero, offload=cfg.offload,
                offload_budget=cfg.offload_budget if cfg.offload == "auto" else None, remat=cfg.remat,
                remat_budget=cfg.remat_budget if cfg.remat == "auto" else None, precision=cfg.precision,
                sp=cfg.sp, **pipe)


def auto_program(cfg: TrainConfig, model, tx, mesh):
    """``--auto``: ``cfx.autoshard``'s plan for this model, batch and mesh, compared with Megatron's."""
    from cfx._src.autoshard.train import AutoProgram, megatron_reference
    program = AutoProgram(model, tx, mesh, batch=cfg.batch, seq=cfg.seq, memory_budget=cfg.auto_budget,
                          grad_clip=cfg.grad_clip, reference=megatron_reference(model, mesh),
                          reference_name="Megatron's plan")
    if 0 in mesh.local_ranks:
        tqdm.write(str(program.report))
    return program


def decay_mask(model) -> Any:
    """Weight decay on matrices only (leaves with two logical axes; not biases, norms), as a
    function of the params so it fits the model's tree and a Plan's stacked layout alike."""
    axes = model.axes()

    def mask(params: Any) -> Any:
        blocks = params.get("blocks")
        if not isinstance(blocks, list):  # a pipe Plan's stacked blocks
            tree = {**axes, "blocks": axes["blocks"][0]}
        elif len(blocks) != len(axes["blocks"]):  # a pipe stage's own blocks (all alike under a Plan)
            tree = {**axes, "blocks": [axes["blocks"][0]] * len(blocks)}
        else:
            tree = axes
        return tree_util.map(lambda names: len(names) >= 2, tree, is_leaf=is_axes_leaf)
    return mask


def build_optimizer(cfg: TrainConfig, model) -> optim.GradientTransformation:
    """AdamW with warmup + cosine; clipping here only on one device (a mesh step clips by the
    global norm across shards itself)."""
    schedule = optim.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup, cfg.steps),
        decay_steps=max(cfg.steps, 1), end_value=cfg.lr * cfg.min_lr_ratio)
    parts = []
    if cfg.grad_clip > 0 and not cfg.mesh:
        parts.append(optim.clip_by_global_norm(cfg.grad_clip))
    parts.append(optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask(model)))
    tx = optim.chain(*parts)
    if amp.policy(cfg.precision).needs_loss_scaling:
        tx = optim.dynamic_loss_scale(tx)
    return tx


def make_train_step(model, tx, policy: amp.Policy):
    grad_fn = scaled_loss_grad(model, policy)

    def step(params, opt_state, tokens, targets, key):
        scale = optim.loss_scale(opt_state) if policy.needs_loss_scaling else 1.0
        (_, loss), grads = grad_fn(params, tokens, targets, key, scale)
        params, opt_state = optim.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    return step


@torch.no_grad()
def evaluate(model, params, policy, val_batches) -> float:
    p = policy.cast_to_compute(params)
    losses = [float(model.loss(p, x, y)) for x, y in val_batches]
    return sum(losses) / len(losses)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the job described by ``cfg``; returns the summary (also printed as a table)."""
    with contextlib.ExitStack() as stack:  # closes the mesh, if any, however the run ends
        return _train(cfg, stack)


def launched_config(cfg: TrainConfig, environ: Mapping[str, str] = os.environ) -> tuple[TrainConfig, str | None]:
    """``(the config to run, a note for the user or None)``. Under torchrun (``WORLD_SIZE`` > 1)
    without ``--mesh`` every process would train the same model on the same batches: train data
    parallel over all of them instead (``--mesh data=WORLD_SIZE``). On the CPU ``--precision
    fp16`` runs in software, about 11x slower than fp32 measured here: say so (bf16 keeps the
    memory saving at fp32's speed or better)."""
    notes = []
    world = int(environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and not cfg.mesh:
        cfg = dataclasses.replace(cfg, mesh=f"data={world}")
        notes.append(f"note: {world} processes and no --mesh: training data parallel, --mesh data={world}.")
    if cfg.precision == "fp16":
        notes.append("note: --precision fp16 on the CPU has no fast fp16 matmuls here (about 11x slower than fp32 "
                     "in our measurement); --precision bf16 halves activation memory at fp32's speed.")
    return cfg, "\n".join(notes) or None


def strategy(cfg: TrainConfig) -> str:
    """Everything that decides how the run trains, defaults included (the summary's row)."""
    parts = [f"mesh {cfg.mesh or 'none (one device)'}", f"precision {cfg.precision}"]
    if cfg.auto:
        return "; ".join(parts + ["auto (cfx.autoshard)" + (f", budget {cfg.auto_budget}" if cfg.auto_budget else "")])
    if cfg.mesh:
        parts.append(f"zero {cfg.zero}")
        parts.append(f"offload {cfg.offload}" + (f" (budget {cfg.offload_budget or 'what is free'})"
                                                 if cfg.offload == "auto" else ""))
    parts.append(f"remat {cfg.remat}" + (f" (budget {cfg.remat_budget})" if cfg.remat == "auto" else ""))
    sp = plan_of(cfg).sp if cfg.mesh else "none"
    if sp != "none":
        parts.append(f"sequence parallel {sp}")
    if "pipe" in (cfg.mesh or ""):
        parts.append(f"schedule {cfg.schedule}, {cfg.microbatches} microbatches"
                     + (f", {cfg.chunks} chunks" if cfg.schedule == "interleaved" else ""))
    return "; ".join(parts)


def _train(cfg: TrainConfig, stack: contextlib.ExitStack) -> dict[str, Any]:
    check_flags(cfg)  # a flag the rest would ignore is refused (the CLI checked what it was given)
    cfg, note = launched_config(cfg)
    if note and int(os.environ.get("RANK", "0") or 0) == 0:
        print(note, file=sys.stderr, flush=True)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    policy = amp.policy(cfg.precision)
    if cfg.save and not (cfg.mesh and sharded_save(cfg.save)):  # a checkpoint that cannot be written fails
        checkpoint.check_writable(cfg.save, what="--save")           # now, not after the last step
    elif cfg.save:
        checkpoint.check_writable(os.path.join(cfg.save, "index.json"), what="--save")
    corpus = data_lib.text_file(cfg.data) if cfg.data else data_lib.stdlib_corpus()
    train_data, val_data = data_lib.train_val_split(corpus)
    model = build_model(cfg)
    k_init, k_data, k_val, k_drop = jr.split(jr.key(cfg.seed), 4)
    val_batches = [data_lib.sample_batch(val_data, jr.fold_in(k_val, i), cfg.batch, cfg.seq)
                   for i in range(cfg.eval_batches)]
    plan = plan_of(cfg) if cfg.mesh else None
    if plan is None or cfg.auto:
        params = model.init(k_init) if plan is None else eval_shape(model.init, k_init)
    else:  # shapes only: the parameter count and a checkpoint's layout
        plan.check(model)  # every flag combination trains or is refused here, before any rank starts
        plan.check_batch(cfg.batch, cfg.seq)
        params = eval_shape(model.init, k_init)
    tx = build_optimizer(cfg, model)
    start, restored, mesh = 0, None, None
    if plan is None:
        remat_plan = (solve_remat(cfg, model, params, val_batches[0][0], k_drop, quiet=not cfg.progress)
                      if cfg.remat == "auto" else None)
        if cfg.resume:
            restored, meta = checkpoint.load(cfg.resume, {"params": params, "opt_state": eval_shape(tx.init, params)})
            start = int(meta.get("step", 0))
        state = (restored["params"], restored["opt_state"]) if restored else (params, tx.init(params))
        run = make_train_step(with_remat(model, cfg.remat, plan=remat_plan), tx, policy)

        def step_fn(state, x, y, key):
            params, opt_state, loss = run(*state, x, y, key)
            return (params, opt_state), loss
        loss_of = lambda state, x, y: evaluate(model, state[0], policy, [(x, y)])  # noqa: E731
        params_of = lambda state: state[0]  # noqa: E731
        saved = lambda state: {"params": state[0], "opt_state": state[1]}  # noqa: E731
    else:
        mesh = stack.enter_context(plan.make_mesh())
        if cfg.auto:  # the searched plan (cfx.autoshard), shown before the first step
            program = auto_program(cfg, model, tx, mesh)
            plan = None  # its checkpoints are single files
        else:
            program = plan.step(model, tx, mesh=mesh, grad_clip=cfg.grad_clip, nvme_dir=cfg.nvme_dir)
        # params and optimizer state live as ShardedArrays: each process builds only its blocks
        state = program.init(k_init)
        if cfg.resume and os.path.isdir(cfg.resume):  # a sharded checkpoint: each process reads its blocks
            state, meta = program.load(cfg.resume, state)
            start = int(meta.get("step", 0))
        elif cfg.resume:  # one file: the saved optimizer state is this plan's, as global tensors
            like = {"params": params, "opt_state": tree_util.map(lambda a: ShapeDtype(a.shape, a.dtype),
                                                                 state.opt_state)}
            restored, meta = checkpoint.load(cfg.resume, like)
            start = int(meta.get("step", 0))
            state = program.put(restored["params"], restored["opt_state"])

        def step_fn(state, x, y, key):
            solved = program.remat_plan
            state, metrics = program(state, (x, y), key)
            if solved is None:  # remat=auto solves on the first batch: show it once
                show_remat_plan(program.remat_plan, quiet=not (cfg.progress and 0 in mesh.local_ranks))
            return state, metrics["loss"]
        loss_of = program.loss
        params_of = program.params
        # one global copy for the single-file checkpoint (every process joins)
        saved = lambda state: {"params": program.params(state), "opt_state": device_get(state.opt_state)}  # noqa: E731
    del restored
    is_main = mesh is None or 0 in mesh.local_ranks  # under torchrun only rank 0 reports and saves
    n_params = tree_util.size(params)

    def save(step: int) -> None:
        meta = {"step": step, "config": dataclasses.asdict(cfg)}
        if plan is not None and sharded_save(cfg.save):  # every process writes its own blocks
            program.save(cfg.save, state, metadata=meta)
            return
        out = saved(state)
        if is_main:
            checkpoint.save(cfg.save, out, metadata=meta)

    def evaluate_all() -> float:
        return sum(loss_of(state, x, y) for x, y in val_batches) / len(val_batches)

    history = {"train": [], "eval": []}
    eval0 = evaluate_all()
    history["eval"].append((start, eval0))
    train_time, tokens = 0.0, 0
    end = min(cfg.steps, start + cfg.stop_after) if cfg.stop_after > 0 else cfg.steps
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not (cfg.progress and is_main),
               desc=f"{cfg.model}-{cfg.preset}", unit="step", mininterval=0.5)
    ema = None
    for step in bar:
        x, y = data_lib.sample_batch(train_data, jr.fold_in(k_data, step), cfg.batch, cfg.seq)
        t0 = time.perf_counter()
        state, loss = step_fn(state, x, y, jr.fold_in(k_drop, step))
        loss = float(loss)
        train_time += time.perf_counter() - t0
        tokens += x.numel()
        if not math.isfinite(loss) and not policy.needs_loss_scaling:
            raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr or use --precision fp32.")
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        history["train"].append((step + 1, loss))
        done = step + 1
        if done == end or (cfg.eval_every and done % cfg.eval_every == 0):
            history["eval"].append((done, evaluate_all()))
        if cfg.save and cfg.save_every and done % cfg.save_every == 0:
            save(done)
        bar.set_postfix(loss=f"{ema:.3f}", eval=f"{history['eval'][-1][1]:.3f}",
                        tok_s=f"{tokens / max(train_time, 1e-9):,.0f}", refresh=False)
    bar.close()
    if cfg.save:
        save(end)
    summary = {
        "model": f"{cfg.model}-{cfg.preset}", "n_params": n_params, "mesh": cfg.mesh or "none", "precision": cfg.precision,
        "strategy": strategy(cfg),
        "steps": end - start, "tokens": tokens,
        "train_loss_first": history["train"][0][1] if history["train"] else float("nan"),
        "train_loss_last": ema if ema is not None else float("nan"),
        "eval_loss_first": eval0, "eval_loss_last": history["eval"][-1][1],
        "tokens_per_s": tokens / train_time if train_time else 0.0, "train_time_s": train_time,
        "history": history, "params": params_of(state),
    }
    if cfg.sample_bytes > 0:
        prompt, key = b"def ", jr.fold_in(k_drop, -1)
        if mesh is None:
            text = sample_bytes(model, policy.cast_to_compute(state[0]), prompt, steps=cfg.sample_bytes, key=key,
                                context=cfg.seq)
        else:  # every process joins the sharded sample; rank 0 prints it
            text = program.sample(state, prompt, steps=cfg.sample_bytes, key=key, context=cfg.seq)
        summary["sample"] = text.decode("utf-8", errors="replace")
    if not is_main:
        return summary
    print_summary(summary)
    if cfg.sample_bytes > 0:
        print(f"\nsample ({cfg.sample_bytes} bytes after 'def ', temperature 0.8):\n{summary['sample']}", flush=True)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "params"}, f, indent=1)
    return summary


def print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("model", s["model"]), ("strategy", s["strategy"]), ("parameters", f"{s['n_params']:,}"),
        ("steps", s["steps"]), ("tokens", f"{s['tokens']:,}"),
        ("train loss (first -> last, EMA)", f"{s['train_loss_first']:.3f} -> {s['train_loss_last']:.3f}"),
        ("eval loss (first -> last)", f"{s['eval_loss_first']:.3f} -> {s['eval_loss_last']:.3f}"),
        ("tokens/s (train steps)", f"{s['tokens_per_s']:,.0f}"), ("train time", f"{s['train_time_s']:.1f} s"),
    ]
    print(format_table(rows, ["summary", "value"]), flush=True)
