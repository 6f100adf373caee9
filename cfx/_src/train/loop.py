"""The training job: a language model on byte-level text, with eval, checkpoints and a summary.

One driver over a ``cfx.parallel.Plan`` (``config.plan_of``): the plan's program is picked up
front -- one device's for the trivial plan (``local.LocalProgram``), ``cfx.autoshard``'s searched
one under ``--auto`` (``AutoProgram``), the plan's own (``Plan.step``) otherwise -- and the loop asks
each the same things: ``init(key)``, ``program(state, (tokens, targets), key) -> (state, {"loss"})``,
``loss``, ``params``, ``put`` and ``sample``. Checkpoints are ``saving``'s. Under ``--lora`` the model
is the adapters over a frozen base (``saving.trained_model``), and every program trains them as it
trains any model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Mapping

import torch
from tqdm.auto import tqdm

from cfx._src.checkpoint import background
from cfx._src.core import random as jr
from cfx._src.lora.model import LoraModel
from cfx._src.models.hf_dir import save_pretrained
from cfx._src.models.parts import vocab_size
from cfx._src.core import tree as tree_util
from cfx._src.core.text import format_table, printable
from cfx._src.plan.lora_base import place_base
from cfx._src.plan.plan import Plan
from cfx._src.precision.amp import policy as amp_policy
from cfx._src.train import data as data_lib
from cfx._src.train import saving
from cfx._src.train.config import TrainConfig, check_flags, plan_of
from cfx._src.train.local import program_for
from cfx._src.train.loggers import RunLog, check_log
from cfx._src.train.moe_stats import router_summary
from cfx._src.train.model import build_optimizer
from cfx._src.transforms.shapes import eval_shape


@dataclasses.dataclass
class Run:
    """A run under way: its program and state, its data and keys (``train``'s parts share it)."""

    cfg: TrainConfig
    program: Any
    state: Any
    start: int                  # the first step of this run (a resumed run's checkpoint step)
    train_data: torch.Tensor
    val_batches: list
    k_data: torch.Tensor        # batch ``step`` is drawn with fold_in(k_data, step)
    k_drop: torch.Tensor        # dropout of step ``step``: fold_in(k_drop, step)
    n_params: int
    is_main: bool               # under torchrun only rank 0 reports and saves
    model: Any = None           # the model it trains (under --lora: the adapters over the frozen base)
    tokenizer: Any = None       # --tokenizer's (the data is its ids), or None (bytes)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> float:
        solved = self.program.remat_plan
        self.state, metrics = self.program(self.state, (tokens, targets), jr.fold_in(self.k_drop, step))
        if solved is None:  # remat=auto solves on the first batch: show it once
            show_remat_plan(self.program.remat_plan, quiet=not (self.cfg.progress and self.is_main))
        return float(metrics["loss"])

    def evaluate(self) -> float:
        return sum(self.program.loss(self.state, x, y) for x, y in self.val_batches) / len(self.val_batches)

    def save(self, step: int) -> float:
        """Save at ``step``; the seconds the loop was held (with ``--async-save``, the host copy)."""
        t0 = time.perf_counter()
        saving.save(self.cfg, self.program, self.state, step, is_main=self.is_main)
        return time.perf_counter() - t0


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the job described by ``cfg``; returns the summary (also printed as a table)."""
    cfg, plan = _checked(cfg)
    with contextlib.ExitStack() as stack:  # closes the mesh, if any, however the run ends
        run = _start(cfg, plan, stack)
        log = RunLog(metrics=cfg.metrics, log=cfg.log, start=run.start, is_main=run.is_main)
        stack.callback(log.close)
        return _finish(run, _fit(run, log), log)


def _checked(cfg: TrainConfig) -> tuple[TrainConfig, Plan]:
    """The config to run and its plan; every refusal that needs no model comes here."""
    check_flags(cfg)  # a flag the rest would ignore is refused (the CLI checked what it was given)
    cfg, note = launched_config(cfg)
    cfg, resumed = saving.resume_auto(cfg)
    note = "\n".join(n for n in (note, resumed) if n)
    if note and int(os.environ.get("RANK", "0") or 0) == 0:
        print(note, file=sys.stderr, flush=True)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    plan = plan_of(cfg)
    saving.check_save(cfg)  # a checkpoint that cannot be written fails now, not after the last step
    check_log(cfg.log)
    return cfg, plan


def _start(cfg: TrainConfig, plan: Plan, stack: contextlib.ExitStack) -> Run:
    """The data, the model, the plan's program (on its mesh, entered on ``stack``) and its state,
    resumed from ``--resume``."""
    tokenizer = data_lib.load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if tokenizer is not None:
        corpus = data_lib.tokenized(cfg.data, tokenizer)
    else:
        corpus = data_lib.text_file(cfg.data) if cfg.data else data_lib.stdlib_corpus()
    train_data, val_data = data_lib.train_val_split(corpus)
    pretrained = None
    if cfg.init_from and not cfg.lora:  # a full fine-tune: its model, starting from its weights
        model, pretrained = saving.base_params(cfg)
    else:
        model = saving.trained_model(cfg)  # under --lora: the adapters over the frozen base
    if tokenizer is not None and len(tokenizer) > vocab_size(model):
        raise ValueError(f"--tokenizer {cfg.tokenizer!r}: {len(tokenizer)} tokens do not fit the model's vocabulary of "
                         f"{vocab_size(model)}; give the model's own tokenizer.")
    k_init, k_data, k_val, k_drop = data_lib.run_keys(cfg.seed)
    val_batches = [data_lib.sample_batch(val_data, jr.fold_in(k_val, i), cfg.batch, cfg.seq)
                   for i in range(cfg.eval_batches)]
    shapes = eval_shape(model.init, k_init)  # the parameter count and a checkpoint's layout
    if not cfg.auto:  # every flag combination trains or is refused here, before any rank starts
        plan.check(model)
        plan.check_batch(cfg.batch, cfg.seq)
    saving.check_resume(cfg, model, shapes)
    saving.check_peft_out(cfg, model)
    mesh = stack.enter_context(plan.make_mesh()) if plan.mesh else None
    nvme_dir = cfg.nvme_dir
    if isinstance(model, LoraModel) and mesh is not None:  # the frozen base kept as the plan keeps its state
        if plan.offload == "nvme" and nvme_dir is None:  # one directory for the base's files and the program's
            nvme_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="cfx-nvme-"))
        model = place_base(model, plan, mesh, nvme_dir=nvme_dir)
    program = program_of(dataclasses.replace(cfg, nvme_dir=nvme_dir), plan, model, mesh)
    # on a mesh ShardedArrays: each process builds (or keeps, of --init-from's) only its blocks
    state = program.init(k_init) if pretrained is None else program.init_from(pretrained)
    state, start = saving.resume(cfg, program, state, model, shapes)  # from any program's checkpoint
    return Run(cfg, program, state, start, train_data, val_batches, k_data, k_drop,
               n_params=tree_util.size(shapes), is_main=mesh is None or 0 in mesh.local_ranks, model=model,
               tokenizer=tokenizer)


def program_of(cfg: TrainConfig, plan: Plan, model, mesh) -> Any:
    """The program the loop drives (module doc): one device's, ``--auto``'s, or the plan's, each
    over the same optimizer (its global-norm clip included: ``build_optimizer``), so that each
    one's state is the same in model coordinates and a checkpoint resumes under any of them."""
    tx = build_optimizer(cfg, model)
    if cfg.auto and mesh is not None:  # the searched plan (cfx.autoshard), shown before the first step
        return auto_program(cfg, model, tx, mesh)
    return program_for(plan, model, tx, mesh, nvme_dir=cfg.nvme_dir)


def auto_program(cfg: TrainConfig, model, tx, mesh):
    """``--auto``: ``cfx.autoshard``'s plan for this model, batch and mesh, compared with Megatron's."""
    from cfx._src.autoshard.train import AutoProgram, megatron_reference
    program = AutoProgram(model, tx, mesh, batch=cfg.batch, seq=cfg.seq, memory_budget=cfg.auto_budget,
                          reference=megatron_reference(model, mesh),
                          reference_name="Megatron's plan")
    if 0 in mesh.local_ranks:
        tqdm.write(str(program.report) if cfg.verbose else program.report.summary())
    return program


@dataclasses.dataclass
class Tally:
    """What a run's steps add up to: the losses and the throughput of its train steps."""

    end: int                                  # the step this run stops after
    history: dict[str, list] = dataclasses.field(default_factory=lambda: {"train": [], "eval": []})
    tokens: int = 0
    time: float = 0.0                         # seconds in train steps (not eval, not saving)
    ema: float | None = None                  # the train loss's moving average
    save_time: float = 0.0                    # seconds the loop was held by saves (not their background writes)

    def add(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        self.history["train"].append((step + 1, loss))
        self.tokens += tokens
        self.time += seconds
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss


def _fit(run: Run, log) -> Tally:
    """The steps from ``run.start`` to ``--steps`` (or ``--stop-after``), evaluating and saving on
    the way, under a progress bar."""
    cfg = run.cfg
    tally = Tally(min(cfg.steps, run.start + cfg.stop_after) if cfg.stop_after > 0 else cfg.steps)
    tally.history["eval"].append((run.start, run.evaluate()))
    scaled = amp_policy(cfg.precision).needs_loss_scaling  # fp16: a step on inf/nan is skipped, not fatal
    bar = tqdm(range(run.start, tally.end), initial=run.start, total=cfg.steps,
               disable=not (cfg.progress and run.is_main), desc=f"{cfg.model}-{cfg.preset}", unit="step",
               mininterval=0.5)
    log(step=run.start, eval=tally.history["eval"][-1][1])
    for step in bar:
        x, y = data_lib.sample_batch(run.train_data, jr.fold_in(run.k_data, step), cfg.batch, cfg.seq)
        t0 = time.perf_counter()
        loss = run.step(x, y, step)
        seconds = time.perf_counter() - t0
        tally.add(step, loss, x.numel(), seconds)
        if not math.isfinite(loss) and not scaled:
            raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr or use --precision fp32.")
        done = step + 1
        log(step=done, loss=loss, tok_s=x.numel() / max(seconds, 1e-9))
        if done == tally.end or (cfg.eval_every and done % cfg.eval_every == 0):
            tally.history["eval"].append((done, run.evaluate()))
            log(step=done, eval=tally.history["eval"][-1][1])
        if cfg.save and cfg.save_every and done % cfg.save_every == 0 and done != tally.end:
            tally.save_time += run.save(done)
        bar.set_postfix(loss=f"{tally.ema:.3f}", eval=f"{tally.history['eval'][-1][1]:.3f}",
                        tok_s=f"{tally.tokens / max(tally.time, 1e-9):,.0f}", refresh=False)
    bar.close()
    if cfg.save:
        tally.save_time += run.save(tally.end)
        background.wait()  # the last checkpoint is committed before the run reports it saved
    return tally


def _finish(run: Run, tally: Tally, log) -> dict[str, Any]:
    """The summary (returned by every process; rank 0 prints it, the sample and ``--json``)."""
    cfg, history = run.cfg, tally.history
    summary = {
        "model": cfg.init_from or f"{cfg.model}-{cfg.preset}", "lora": cfg.lora, "n_params": run.n_params,
        "mesh": cfg.mesh or "none",
        "precision": cfg.precision, "strategy": strategy(cfg), "steps": tally.end - run.start,
        "tokens": tally.tokens,
        "train_loss_first": history["train"][0][1] if history["train"] else float("nan"),
        "train_loss_last": tally.ema if tally.ema is not None else float("nan"),
        "eval_loss_first": history["eval"][0][1], "eval_loss_last": history["eval"][-1][1],
        "tokens_per_s": tally.tokens / tally.time if tally.time else 0.0, "train_time_s": tally.time,
        "save_blocked_s": tally.save_time,
        "history": history, "params": run.program.params(run.state),
        "data": cfg.data or "the Python standard library's source text", "threads": torch.get_num_threads(),
        "saved": cfg.save or None, "peft": cfg.save_peft or None,
    }
    saving.write_peft(cfg, run.model, summary["params"], is_main=run.is_main)  # --save-peft: the adapters, gathered
    if cfg.save_hf and run.is_main:  # the whole model, gathered, as transformers reads it (and its tokenizer)
        save_pretrained(cfg.save_hf, run.model, summary["params"])
        if run.tokenizer is not None:
            run.tokenizer.save_pretrained(cfg.save_hf)
        summary["saved_hf"] = cfg.save_hf
    if cfg.sample_bytes > 0 and run.tokenizer is None:  # (bytes; on a mesh every process joins the sharded sample)
        text = run.program.sample(run.state, b"def ", steps=cfg.sample_bytes, key=jr.fold_in(run.k_drop, -1),
                                  context=cfg.seq)
        summary["sample"] = text.decode("utf-8", errors="replace")
    if not run.is_main:
        return summary
    router = router_summary(run.model, summary["params"], run.val_batches)  # an MoE model's routing, held out
    if router is not None:
        summary["router"] = router
        log(step=tally.end, router_max_load=router["max_load"], router_dropped=router["dropped"])
    print_summary(summary)
    if cfg.plot:
        plot_losses(history, cfg.plot, title=f"{summary['model']}: {summary['strategy']}")
    if "sample" in summary:
        print(f"\nsample ({cfg.sample_bytes} bytes after 'def ', temperature 0.8):\n{printable(summary['sample'])}",
              flush=True)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "params"}, f, indent=1)
    return summary


def show_remat_plan(plan, *, quiet: bool) -> None:
    if plan is not None and not quiet:
        tqdm.write(str(format_table(plan.summary(), ["remat plan", "value"])))


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
    busy = _busy_cores(environ)
    if cfg.threads == 0 and busy is not None:  # what the diagnosis recommends, applied (--threads N overrides)
        notes.append(f"note: the machine is busy (load {busy[0]:.1f} on {busy[1]} cores): training with 1 intra-op "
                     f"thread, not {torch.get_num_threads()}, which would wait on each other (1 ran the demo ~5x faster "
                     "on a loaded 2-core machine); --threads N chooses.")
        cfg = dataclasses.replace(cfg, threads=1)
    if cfg.precision == "fp16":
        notes.append("note: --precision fp16 on the CPU has no fast fp16 matmuls here (about 11x slower than fp32 "
                     "in our measurement); --precision bf16 halves activation memory at fp32's speed.")
    return cfg, "\n".join(notes) or None


def _busy_cores(environ: Mapping[str, str]) -> tuple[float, int] | None:
    """``(1-minute load, cores)`` when the load leaves this process less than its threads' worth, else None."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None
    return (load, cores) if torch.get_num_threads() > 1 and load >= cores - 0.5 else None


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
    if cfg.lora:
        parts.append(f"lora {cfg.lora} over a frozen {cfg.lora_base or cfg.precision} base"
                     + (f" from {cfg.init_from}" if cfg.init_from else ""))
    plan = plan_of(cfg)
    if plan.sp != "none":
        parts.append(f"sequence parallel {plan.sp}")
    if plan.tp:
        parts.append(f"tensor parallel {plan.tp} (grid)")
    if plan.has("pipe"):
        parts.append(f"schedule {cfg.schedule}, {cfg.microbatches} microbatches"
                     + (f", {cfg.chunks} chunks" if cfg.schedule == "interleaved" else ""))
    return "; ".join(parts)


def plot_losses(history: dict, path: str, *, title: str) -> None:
    """The train loss of every step and each evaluation, against the step, as a PNG (``--plot``)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'cfx[plots]'.") from e
    matplotlib.use("Agg")  # files only: no display is needed or opened
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("train", "-"), ("eval", "o-")):
        if history[name]:
            steps, losses = zip(*history[name])
            ax.plot(steps, losses, style, label=name, markersize=3)
    ax.set(xlabel="step", ylabel="loss (nats per token)", title=title[:90])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curves: {path}", flush=True)


def print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("model", s["model"]), ("strategy", s["strategy"]),
        ("parameters", f"{s['n_params']:,}" + (" (trained: the adapters)" if s.get("lora") else "")),
        ("data", s["data"]), ("threads", f"{s['threads']} intra-op (--threads; 1 is fastest on a busy machine)"),
        ("steps", s["steps"]), ("tokens", f"{s['tokens']:,}"),
        ("train loss (first -> last, EMA)", f"{s['train_loss_first']:.3f} -> {s['train_loss_last']:.3f}"),
        ("eval loss (first -> last)", f"{s['eval_loss_first']:.3f} -> {s['eval_loss_last']:.3f}"),
        ("tokens/s (train steps)", f"{s['tokens_per_s']:,.0f}"), ("train time", f"{s['train_time_s']:.1f} s"),
    ]
    if s.get("router"):
        r = s["router"]
        rows.append(("MoE routers (held-out batches)", f"busiest expert {r['max_load']:.2f}x an even share; "
                                                       f"{r['dropped']:.1%} of rows dropped over capacity"))
    if s.get("saved"):
        rows.append(("saved", f"{s['saved']} (continue with --resume {s['saved']}; saves held the loop "
                              f"{s['save_blocked_s']:.2f} s)"))
    if s.get("saved_hf"):
        rows.append(("Hugging Face directory", f"{s['saved_hf']} (transformers' from_pretrained loads it)"))
    if s.get("peft"):
        rows.append(("peft adapter", f"{s['peft']} (peft.PeftModel.from_pretrained(base model, {s['peft']!r}))"))
    print(format_table(rows, ["summary", "value"]), flush=True)
    if s.get("saved_hf") or s.get("saved"):  # the next step: talk to it
        print(f"next: python -m cfx.generate --checkpoint {s.get('saved_hf') or s['saved']} --prompt 'def '", flush=True)
