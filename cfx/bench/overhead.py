"""Overhead of cfx's functional style, eager and compiled: one GPT-2 train step (loss, grads,
AdamW) against the same math as a ``torch.nn.Module`` with ``torch.optim.AdamW``.

Rows (each side by side, in one process, on the same weights, batch and hyperparameters, in
interleaved rounds; ratios of median step times). The Module's optimizer is torch's fastest
AdamW, ``fused=True`` (one pass per parameter, in place: the kernel cfx's donated eager step
runs too); the ratios against the ``foreach`` AdamW (torch's default) are reported beside them:

- ``eager_vs_module_{small,large}``: the cfx step run eagerly with its state donated
  (``cfx.jit(step, donate_argnums=0, compile=False)``; ``optim.apply_gradients`` steps AdamW
  in place, in one pass) over the eager Module step (target <= 1.05);
- ``eager_vs_module_dispatch_cpu``: the same two steps on a GPT-2 small enough that dispatch
  dominates (2 layers of width 64, 4 heads, a byte vocabulary of 256 as ``python -m cfx.train``'s,
  B=2, T=32), on the CPU: what each side spends in Python per op and per step (pytree walks,
  checks, donation) against torch's own, the CPU proxy for a GPU step whose kernels are shorter
  than their launches (target <= 1.10). The vocabulary is small on purpose: with GPT-2's 50257
  the head's matmul and the loss take most of the step and the row would not measure dispatch;
- ``jit_vs_compiled_{small,large}``: ``cfx.jit`` (one inductor graph: forward, backward and AdamW,
  donated) over the ``torch.compile``d Module stepping its AdamW eagerly (target <= 1.00);
- ``jit_speedup_large``: eager cfx over ``cfx.jit`` (target >= 1.2), with compile times and the
  recompiles over 20 steps (target 0);
- ``jit_compile_s_vs_torch_compile``: ``cfx.jit(step, compile="blocks")`` (each distinct block
  compiled once, the rest eager) first call over ``torch.compile(Module)``'s, both cold (inductor's
  caches off) (target <= 1.5), with its step time beside the whole-graph ``cfx.jit``'s.

Both sides free their gradients at the end of a step (the Module calls ``zero_grad`` after
``opt.step()``): where one side keeps a model's worth of gradients alive between steps, the
other's fresh allocations land on pages the C allocator gave back to the system, and page faults,
not the math, decide the ratio (measured: 1.69 with the Module's ``zero_grad`` first, 1.07 with
it last, before the fused apply).

Sizes: small is B=1, T=64 and large B=4, T=256 on GPT-2 small; ``--quick`` runs the small size
on a 2-layer GPT-2 (and no large size), to finish in about a minute; ``--smoke`` its eager phase on
a toy GPT-2 (nothing compiled). The dispatch row runs at every size (nothing compiled; fewer
rounds under ``--quick`` and ``--smoke``). Also reported: the tokens/s of ``python -m cfx.train``
on its defaults (a shortened run under ``--quick``, two toy steps under ``--smoke``).
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch

import cfx
from cfx import models, optim
from cfx.bench.common import Row, interleaved_medians, report, size_of
from cfx.bench.torch_gpt2 import TorchGPT2
from cfx._src.train.config import TrainConfig
from cfx._src.train.loop import train

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


class State(NamedTuple):
    params: dict
    opt: tuple


class Side:
    """One way of running the step: ``step()`` runs one, ``loss`` is the last loss."""

    def __init__(self, run):
        self.run, self.loss, self.jitted = run, None, None

    def __call__(self) -> None:
        self.loss = float(self.run())


def sides(model, batch: int, seq: int, *, seed: int = 0, compiled: bool = True) -> dict[str, Side]:
    """The step five ways (cfx eager, cfx.jit; the Module eager with fused and with foreach AdamW,
    compiled with fused), identical start."""
    params = model.init(cfx.random.key(seed))
    k = cfx.random.split(cfx.random.key(seed + 1), 2)
    tokens = cfx.random.randint(k[0], (batch, seq), 0, model.config.vocab_size)
    targets = cfx.random.randint(k[1], (batch, seq), 0, model.config.vocab_size)
    tx = optim.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])

    def step(state, tokens, targets):
        loss, grads = cfx.value_and_grad(model.loss)(state.params, tokens, targets)
        return State(*optim.apply_gradients(tx, grads, state.opt, state.params)), loss

    def cfx_side(stepper) -> Side:
        box = [State(cfx.tree.map(torch.clone, params), tx.init(params))]

        def run():
            box[0], loss = stepper(box[0], tokens, targets)
            return loss
        side = Side(run)
        side.jitted = stepper
        return side

    def module_side(compile_it: bool, kernel: str = "fused") -> Side:
        module = TorchGPT2(model.config).load_cfx(params)
        forward = torch.compile(module) if compile_it else module
        opt = torch.optim.AdamW(module.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"],
                                weight_decay=HP["weight_decay"], **{kernel: True})

        def run():  # the grads are dropped at the end of the step, as the cfx step drops its own
            loss = forward(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return Side(run)

    out = {"cfx": cfx_side(cfx.jit(step, donate_argnums=0, compile=False)), "module": module_side(False),
           "module_foreach": module_side(False, "foreach")}
    if compiled:
        out["jit"] = cfx_side(cfx.jit(step, donate_argnums=0))
        out["blocks"] = cfx_side(cfx.jit(step, donate_argnums=0, compile="blocks"))
        out["compiled"] = module_side(True)
    return out


def _compile(side: Side) -> float:
    t0 = time.perf_counter()
    side()
    return time.perf_counter() - t0


def measure(model, batch: int, seq: int, rounds: int, label: str, *,
            compiled: bool = True) -> tuple[list[Row], dict]:
    """Two phases, each interleaved: the eager pair first (before anything is compiled, so that
    neither pays for the compiled sides' memory and worker processes), then cfx.jit, the compiled
    Module and eager cfx again (the speedup's two sides side by side). ``compiled=False``: the
    first phase alone (the smoke size: a cold inductor compile takes half a minute)."""
    s = sides(model, batch, seq, compiled=compiled)
    eager = ["cfx", "module", "module_foreach"]
    for n in eager:
        s[n]()
    first = {n: s[n].loss for n in eager}
    t = dict(zip(eager, interleaved_medians([s[n] for n in eager], rounds=rounds, warmup=0)))
    rows = [
        Row(f"eager_vs_module_{label}: cfx eager (donated) / nn.Module eager + fused AdamW, "
            f"{_cfg(model, batch, seq)}", t["cfx"] / t["module"], "x", "<= 1.05", t["cfx"] / t["module"] <= 1.05),
        Row(f"  cfx eager / nn.Module eager + foreach AdamW (torch's default), {label}",
            t["cfx"] / t["module_foreach"], "x", "info"),
    ]
    if compiled:
        rows += _compiled_phase(s, t, first, rounds, label)
    spread = max(first.values()) - min(first.values())
    rows.append(Row(f"  first-step loss, max |difference| of the {len(first)} ({label})", spread, "nats",
                    "<= 1e-4", spread <= 1e-4))
    return rows, t


def _compiled_phase(s: dict[str, Side], t: dict, first: dict, rounds: int, label: str) -> list[Row]:
    """The second phase's rows; adds its times to ``t`` and its first losses to ``first``."""
    import torch._inductor.config as inductor_config

    with _patched(inductor_config, force_disable_caches=True):  # cold compiles: no side reuses another's kernels
        jit_compile, module_compile, blocks_compile = (_compile(s[n]) for n in ("jit", "compiled", "blocks"))
    first.update(jit=s["jit"].loss, compiled=s["compiled"].loss, blocks=s["blocks"].loss)
    names = ["jit", "compiled", "cfx", "blocks"]
    t2 = dict(zip(names, interleaved_medians([s[n] for n in names], rounds=rounds, warmup=0)))
    t.update(jit=t2["jit"], compiled=t2["compiled"], cfx_with_compiled=t2["cfx"], blocks=t2["blocks"])
    for _ in range(20):
        s["jit"]()
    recompiles = s["jit"].jitted.stats().recompiles  # over every call: the rounds and 20 more steps
    return [
        Row(f"jit_vs_compiled_{label}: cfx.jit / torch.compile(nn.Module) + fused AdamW",
            t["jit"] / t["compiled"], "x", "<= 1.00", t["jit"] / t["compiled"] <= 1.00),
        Row(f"  step times ({label}): cfx eager / Module eager fused / foreach | cfx.jit / compiled Module / "
            "cfx eager", t["cfx"], "s", f"{t['module']:.3f} / {t['module_foreach']:.3f} | {t['jit']:.3f} / "
            f"{t['compiled']:.3f} / {t['cfx_with_compiled']:.3f} s"),
        Row(f"  compile time ({label}): cfx.jit (first call: trace, compile, run) / torch.compile(Module)",
            jit_compile, "s", f"{module_compile:.1f} s"),
        Row(f"  cfx.jit recompiles after the first compile (rounds + 20 steps, {label})", recompiles, "", "0",
            recompiles == 0),
        Row(f"jit_compile_s_vs_torch_compile ({label}): cfx.jit(compile='blocks') first call / torch.compile(Module)'s",
            blocks_compile / module_compile, "x", "<= 1.5", blocks_compile / module_compile <= 1.5),
        Row(f"  compile='blocks' ({label}): first call / step time over the whole-graph cfx.jit's", blocks_compile,
            "s", f"step {t['blocks'] / t['jit']:.2f}x cfx.jit's"),
    ]


@contextlib.contextmanager
def _patched(config, **values):
    old = {k: getattr(config, k) for k in values}
    for k, v in values.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(config, k, v)


def _cfg(model, batch: int, seq: int) -> str:
    return f"GPT-2 {model.config.n_layer} layers, B={batch}, T={seq}"


DISPATCH = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)  # launches dominate
DISPATCH_BATCH = (2, 32)


def dispatch_rows(rounds: int) -> list[Row]:
    """``eager_vs_module_dispatch_cpu``: cfx's eager donated step over the Module's with fused
    AdamW on the tiny GPT-2 of ``DISPATCH``, on the CPU: interleaved medians of ``rounds`` steps
    each, after 20 warm-up steps each."""
    model = models.gpt2("tiny", **DISPATCH)
    s = sides(model, *DISPATCH_BATCH, compiled=False)
    fns = [s["cfx"], s["module"]]
    for _ in range(20):
        for f in fns:
            f()
    t_cfx, t_module = interleaved_medians(fns, rounds=rounds, warmup=0)
    ratio = t_cfx / t_module
    B, T = DISPATCH_BATCH
    cfg = f"GPT-2 {DISPATCH['n_layer']} x {DISPATCH['n_embd']}, vocab {DISPATCH['vocab_size']}, B={B}, T={T}"
    return [
        Row(f"eager_vs_module_dispatch_cpu: cfx eager (donated) / nn.Module eager + fused AdamW, {cfg}, CPU",
            ratio, "x", "<= 1.10", ratio <= 1.10),
        Row("  step times (dispatch_cpu): cfx eager / nn.Module eager + fused AdamW", t_cfx, "s",
            f"{t_module * 1e3:.2f} ms for the Module"),
    ]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    rows = dispatch_rows({"smoke": 20, "quick": 200, "full": 600}[size])
    if size == "smoke":
        toy = models.gpt2("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        rows += measure(toy, 1, 16, rounds=1, label="toy", compiled=False)[0]
    elif size == "quick":
        small = models.gpt2("small", n_layer=2)
        rows += measure(small, 1, 64, rounds=6, label="small")[0]
    else:
        gpt2 = models.gpt2("small")
        rows += measure(gpt2, 1, 64, rounds=10, label="small")[0]
        large_rows, t = measure(gpt2, 4, 256, rounds=8, label="large")
        rows += large_rows
        speedup = t["cfx_with_compiled"] / t["jit"]
        rows.append(Row("jit_speedup_large: cfx eager / cfx.jit, B=4, T=256", speedup, "x", ">= 1.2",
                        speedup >= 1.2))
    steps = {"smoke": 2, "quick": 40, "full": TrainConfig().steps}[size]
    toy = dict(batch=2, seq=16, eval_batches=1, sample_bytes=0) if size == "smoke" else {}
    summary = train(TrainConfig(steps=steps, eval_every=0, progress=False, **toy))
    rows += [
        Row(f"python -m cfx.train defaults ({steps} steps) tokens/s", summary["tokens_per_s"], "tok/s"),
        Row("python -m cfx.train eval loss first -> last", summary["eval_loss_last"], "nats",
            f"< {summary['eval_loss_first']:.3f}", summary["eval_loss_last"] < summary["eval_loss_first"]),
    ]
    return report("overhead", rows, json_path)
