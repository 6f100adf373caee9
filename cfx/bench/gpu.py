"""``python -m cfx.bench gpu``: the figures the GPU issues ask for, in one command (about 6 minutes on
one H100), printed and, with ``--json``, written.

* Training, GPT-2 small, bf16 compute, fused AdamW, the same math on every side
  (``cfx.bench.torch_gpt2.TorchGPT2`` as the Module): the Module eager under autocast, cfx eager
  (donated, ``cfx.amp.policy("bf16")``), ``torch.compile(Module)`` and ``cfx.jit(step,
  donate_argnums=0)``, at B16 x 1024 (all four) and B2 x 256 (the eager pair, where launches
  dominate): step time, tokens/s, MFU = tokens/s x (6 N + 12 L C T) / 989e12 (N without wpe; H100
  SXM bf16 dense), peak memory, compile time, and each side's first loss against the Module's.
  Rows ``jit_vs_compiled_gpu``, ``jit_tokens_per_s_gpu``, ``eager_vs_module_gpu_small`` / ``_large``,
  ``peak_memory_vs_module_gpu``.
* Generation (``cfx.bench.gpu_generate``) and the kernels' CUDA rows (``cfx.bench.kernels``).

It runs on a GPU machine's stock image (torch preinstalled; optree carried as a wheel). Without
CUDA every GPU row is printed as skipped (value 0, ok false in the JSON), never as passing; ``--smoke`` then
runs the same measuring code on the CPU at toy sizes (rows marked "cpu smoke": the code runs, the
figures mean nothing), so the command cannot rot between the sessions that have a GPU.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch

import cfx
from cfx import optim
from cfx.bench import gpu_generate, kernels_attention, kernels_linear_xent, kernels_misc
from cfx.bench.common import Row, report, size_of, skipped
from cfx.bench.torch_gpt2 import TorchGPT2, autocast_step

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
PEAK_FLOPS = 989e12  # H100 SXM, bf16 dense
SIZES = {"full": ({}, (16, 1024), (2, 256), 20), "quick": ({}, (8, 1024), (2, 256), 10),
         "smoke": (dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32), (2, 32), (1, 16), 2)}


class State(NamedTuple):
    params: dict
    opt: tuple


class Side(NamedTuple):
    name: str
    step: Callable[[], torch.Tensor]  # one training step; returns the loss


def sides(model, batch: int, seq: int, device: str, *, compiled: bool) -> list[Side]:
    """The step four ways (two without ``compiled``), from the same weights and batch; compiled with
    inductor on the GPU, with aot_eager on the CPU smoke (the path, not the figures: a cold C++ compile
    would cost the suite ~20 s)."""
    backend = "inductor" if device == "cuda" else "aot_eager"
    params = cfx.tree.map(lambda x: x.to(device), model.init(cfx.random.key(0)))
    k = cfx.random.split(cfx.random.key(1), 2)
    tokens, targets = (cfx.random.randint(kk, (batch, seq), 0, model.config.vocab_size).to(device) for kk in k)
    tx = optim.adamw(HP["lr"], b1=HP["betas"][0], b2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])
    policy = cfx.amp.policy("bf16")

    def step(state, tokens, targets):
        loss, grads = cfx.value_and_grad(lambda p: model.loss(policy.cast_to_compute(p), tokens, targets))(
            state.params)
        return State(*optim.apply_gradients(tx, grads, state.opt, state.params)), loss

    def cfx_side(name: str, stepper) -> Side:
        box = [State(cfx.tree.map(torch.clone, params), tx.init(params))]

        def run():
            box[0], loss = stepper(box[0], tokens, targets)
            return loss
        return Side(name, run)

    def module_side(name: str, compile_it: bool) -> Side:
        module = TorchGPT2(model.config).load_cfx(params).to(device)
        forward = torch.compile(module, backend=backend) if compile_it else module
        opt = torch.optim.AdamW(module.parameters(), fused=True, **HP)

        return Side(name, lambda: autocast_step(forward, opt, tokens, targets))

    out = [module_side("module", False), cfx_side("cfx", cfx.jit(step, donate_argnums=0, compile=False))]
    if compiled:
        out += [module_side("compiled", True), cfx_side("jit", cfx.jit(step, donate_argnums=0, verbose=False, backend=backend))]
    return out


def measure(side: Side, steps: int, device: str) -> dict:
    """First loss, first-call seconds (the compile, for compiled sides), median step seconds, peak bytes."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first = float(side.step())
    first_s = time.perf_counter() - t0
    for _ in range(2):
        side.step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        side.step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return dict(loss=first, first_s=first_s, step_s=statistics.median(times), peak=peak)


def flops_per_token(model, T: int) -> float:
    """6 N + 12 L C T: N the params without the position table (PaLM's MFU, nanoGPT's estimate)."""
    c = model.config
    n = sum(x.numel() for x in cfx.tree.leaves(model.init(cfx.random.key(0)))) - c.n_positions * c.n_embd
    return 6 * n + 12 * c.n_layer * c.n_embd * T


def training_rows(size: str, device: str) -> list[Row]:
    kw, (B, T), (b, t), steps = SIZES[size]
    model = cfx.models.gpt2("small", **kw)
    tag = "" if device == "cuda" else " [cpu smoke]"
    rows, res = [], {}
    for (bb, tt), label, compiled in (((B, T), "large", True), ((b, t), "small", False)):
        flops = flops_per_token(model, tt)
        for side in sides(model, bb, tt, device, compiled=compiled):
            try:
                r = measure(side, steps, device)
            except Exception as e:  # noqa: BLE001 -- one side failing is its row; the others still measure
                rows.append(Row(f"  {side.name} B{bb}x{tt} FAILED: {type(e).__name__}: {str(e)[:200]}{tag}", 0.0,
                                "error", "runs", False))
                continue
            res[side.name, label] = r
            tokens_s = bb * tt / r["step_s"]
            mfu = tokens_s * flops / PEAK_FLOPS
            rows.append(Row(f"  {side.name} B{bb}x{tt}: step ms / tokens/s / MFU / peak GiB / first call s{tag}",
                            r["step_s"] * 1e3, f"ms; {tokens_s:,.0f} tok/s; MFU {mfu:.1%}; "
                            f"{r['peak'] / 2**30:.2f} GiB; {r['first_s']:.1f} s"))
            if ("module", label) in res:
                rows.append(Row(f"  {side.name} B{bb}x{tt}: |first loss - the Module's|{tag}",
                                abs(r["loss"] - res["module", label]["loss"]), "nats"))

    def ratio(metric: str, target: str, a: str, b: str, label: str, bound: float, key: str = "step_s") -> Row:
        if (a, label) not in res or (b, label) not in res:
            return Row(f"{metric}{tag}", 0.0, "not measured: a side failed (above)", target, False)
        x = res[a, label][key] / res[b, label][key]
        return Row(f"{metric}{tag}", x, "x", target, x <= bound)

    rows += [ratio(f"jit_vs_compiled_gpu (cfx.jit / torch.compile(Module), B{B}x{T} bf16)", "<= 1.00", "jit", "compiled",
                   "large", 1.0)]
    if ("jit", "large") in res:
        jit_tokens = B * T / res["jit", "large"]["step_s"]
        rows.append(Row(f"jit_tokens_per_s_gpu (GPT-2 small, B{B}x{T}){tag}", jit_tokens, "tok/s", ">= 460,000",
                        jit_tokens >= 460_000))
    rows += [ratio(f"eager_vs_module_gpu_small (B{b}x{t})", "<= 1.10", "cfx", "module", "small", 1.10),
             ratio(f"eager_vs_module_gpu_large (B{B}x{T})", "<= 1.02", "cfx", "module", "large", 1.02),
             Row("  MFU formula: tokens/s x (6 N + 12 L C T) / 989e12, N = params without wpe", 0.0, "-")]
    if device == "cuda":
        rows.append(ratio("peak_memory_vs_module_gpu (cfx.jit / compiled Module)", "<= 1.00", "jit", "compiled", "large",
                          1.0, "peak"))
    return rows


def medium_rows(device: str, *, smoke: bool = False) -> list[Row]:
    """A measured GPT-2 medium step (B8 x 1024, bf16 compute, fused AdamW; cfx eager and the Module eager):
    the figure ``estimate_vs_measured_gpu`` compares ``cfx.parallel.estimate``'s ``h200`` preset with."""
    kw, (B, T), steps = (SIZES["smoke"][0], (2, 32), 2) if smoke else ({}, (8, 1024), 10)
    model = cfx.models.gpt2("medium", **kw)
    tag = "" if device == "cuda" else " [cpu smoke]"
    flops = flops_per_token(model, T)
    rows, measured = [], {}
    for side in sides(model, B, T, device, compiled=False):
        r = measure(side, steps, device)
        measured[side.name] = r["step_s"]
        tokens_s = B * T / r["step_s"]
        rows.append(Row(f"gpt2_medium_step_s_gpu {side.name} (B{B}x{T} bf16, MFU {tokens_s * flops / PEAK_FLOPS:.1%}, "
                        f"{r['peak'] / 2**30:.1f} GiB){tag}", r["step_s"], "s"))
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    preset = "h200" if "H200" in name else "h100-80gb" if "H100" in name else "a100-80gb" if "A100" in name else "h200"
    e = cfx.parallel.estimate(model, cfx.parallel.Plan.parse("precision=bf16"), cfx.parallel.Cluster.preset(preset, 1),
                              batch=(B, T))
    ratio = e.step_s / measured["cfx"]
    rows.append(Row(f"estimate_vs_measured_gpu (cfx.parallel.estimate's {preset} preset {e.step_s * 1e3:.1f} ms / the "
                    f"measured cfx step){tag}", ratio, "x", "0.90-1.10", 0.9 <= ratio <= 1.1 or bool(tag)))
    return rows


GPU_ROWS = [("jit_vs_compiled_gpu", "<= 1.00"), ("jit_tokens_per_s_gpu", ">= 460,000"),
            ("eager_vs_module_gpu_small", "<= 1.10"), ("eager_vs_module_gpu_large", "<= 1.02"),
            ("peak_memory_vs_module_gpu", "<= 1.00")]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    if torch.cuda.is_available():
        rows = [Row(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", 0.0, "-")]
        rows += training_rows(size, "cuda") + gpu_generate.rows(size, "cuda")
        ksize = "smoke" if size == "smoke" else "quick"
        rows += kernels_attention.cuda_rows(ksize) + kernels_misc.cuda_rows(ksize)
        rows += kernels_linear_xent.cuda_rows(ksize)
    else:
        rows = [skipped(m, t) for m, t in GPU_ROWS + gpu_generate.GPU_ROWS]
        if smoke:  # the measuring code, on the CPU at toy sizes
            rows += training_rows("smoke", "cpu") + gpu_generate.rows("smoke", "cpu")
    return report("gpu", rows, json_path)
