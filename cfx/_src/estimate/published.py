"""Published training runs the estimate is checked against (never fitted row by row: one set of
constants per GPU kind, ``constants.EFFICIENCY``).

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large TransformerShape Models", Table 3
  (configurations: sequence 2048, vocabulary 51200, tensor parallel 8, micro-batch 1 but the 22B's 4) and
  Table 5 (seconds per iteration, full recomputation and sequence parallelism + selective recomputation)
  on Selene (DGX A100 80 GB, HDR InfiniBand); the pipeline schedule as Calculon's validation configures
  it (interleaved with 3 chunks for 175B and 530B).
- Korthikanti et al. 2022 Fig. 1 (memory per GPU of the same four models: parameters and optimizer state,
  activations of tensor + pipeline parallelism alone, and with sequence parallelism + selective
  recomputation). The bars are the paper's equations (Section 4: ``s b h L (10 + 24/t + 5as/ht)`` and
  ``34 s b h L / t`` on the first stage, which holds ``L`` layers' worth under 1F1B, times ``1 + (p-1)/pm``
  interleaved over ``m`` chunks; mixed-precision Adam's 16 bytes a parameter, ``2 + 2 + 12``, of Narayanan
  et al.'s parameter count ``12 l h^2 (1 + 13/12h + (V + s)/12lh)``), so those
  equations are what ``korthikanti_fig1`` computes for each bar.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (weak scaling, 1.7B-1T: teraFLOP/s per GPU counted with full recomputation,
  ``96 B s l h^2 (1 + s/6h + V/16lh)``); the paper does not list micro-batches: one row per pipeline
  micro-batch, the data-parallel rank's rows at once without a pipeline, the non-interleaved schedule.
"""
from __future__ import annotations

import dataclasses

from cfx._src.estimate.cluster import Cluster
from cfx._src.estimate.estimate import estimate
from cfx._src.estimate.workload import TransformerShape
from cfx._src.plan.plan import Plan

SEQ, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Run:
    """One published row: the model, the plan's text, the global batch, what the paper measured."""

    source: str
    name: str
    shape: TransformerShape
    plan: str
    rows: int
    value: float        # seconds per iteration (Table 5) or teraFLOP/s per GPU (Table 1)
    unit: str
    gpu: str = "a100-80gb"


def _gpt(name: str, hidden: int, layers: int, heads: int) -> TransformerShape:
    return TransformerShape.gpt(hidden, layers, heads, VOCAB, name=name)


# name, hidden, layers, heads, tensor x pipe, global batch, interleaved chunks, full recompute s, SP + selective s
_TABLE5 = [("22B", 6144, 48, 64, 8, 1, 4, 1, 1.42, 1.10), ("175B", 12288, 96, 96, 8, 8, 64, 3, 18.13, 13.75),
           ("530B", 20480, 105, 128, 8, 35, 280, 3, 49.05, 37.83), ("1T", 25600, 128, 160, 8, 64, 512, 1, 94.42, 71.49)]

# billions of params, heads, hidden, layers, tensor, pipe, GPUs, global batch, teraFLOP/s per GPU
_TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def _mesh(pipe: int, data: int, model: int) -> str:
    return ",".join(f"{a}={n}" for a, n in (("pipe", pipe), ("data", data), ("model", model)) if n > 1)


def korthikanti_table5() -> list[Run]:
    out = []
    for name, h, l, a, t, p, rows, chunks, full, selective in _TABLE5:
        pipe = f" microbatches={rows}" + (f" schedule=interleaved chunks={chunks}" if chunks > 1 else "") if p > 1 else ""
        for mode, tail, value in (("full recompute", "remat=blocks", full), ("SP + selective", "remat=dots sp=megatron", selective)):
            out.append(Run("Korthikanti et al. 2022 Table 5", f"{name} {mode}", _gpt(name, h, l, a),
                           f"{_mesh(p, 1, t)} {tail} precision=fp16{pipe}", rows, value, "s"))
    return out


def korthikanti_fig1() -> list[tuple[str, float, float]]:
    """``(bar, the estimate's bytes per GPU, the paper's)`` for each model of Table 3 as Table 5 ran it (module
    doc): parameters + optimizer state, activations without and with sequence parallelism + selective
    recomputation (the estimate's ``activations``; the logits it counts apart, which the figure leaves out)."""
    out = []
    for name, h, l, a, t, p, rows, chunks, _, _ in _TABLE5:
        shape, b = _gpt(name, h, l, a), 4 if name == "22B" else 1
        sbh, pipe = SEQ * b * h, ""
        if p > 1:
            pipe = f" microbatches={rows // b}" + (f" schedule=interleaved chunks={chunks}" if chunks > 1 else "")
        first_stage = l * (1 + (p - 1) / (p * chunks) if chunks > 1 else 1)
        for bar, tail, per_layer in (
                ("activations, tensor + pipeline", "remat=none", sbh * (10 + 24 / t + 5 * a * SEQ / (h * t))),
                ("activations, + SP + selective", "remat=dots sp=megatron", sbh * 34 / t)):
            plan = Plan.parse(f"{_mesh(p, 1, t)} {tail} precision=fp16{pipe}")
            e = estimate(shape, plan, Cluster.preset("a100-80gb", plan.world_size), batch=(rows, SEQ), stack="megatron")
            if not out or not out[-1][0].startswith(name):
                state = sum(e.memory[k] for k in ("params", "grads", "optimizer"))
                params = 12 * l * h * h * (1 + 13 / (12 * h) + (VOCAB + SEQ) / (12 * l * h))  # Narayanan et al. eq. (2)
                out.append((f"{name} parameters + optimizer state", state, 16 * params / (t * p)))
            out.append((f"{name} {bar}", e.memory["activations"], per_layer * first_stage))
    return out


def narayanan_table1() -> list[Run]:
    out = []
    for billions, a, h, l, t, p, gpus, rows, tflops in _TABLE1:
        d = gpus // (t * p)
        pipe = f" microbatches={rows // d}" if p > 1 else ""
        out.append(Run("Narayanan et al. 2021 Table 1", f"{billions}B", _gpt(f"{billions}B", h, l, a),
                       f"{_mesh(p, d, t)} remat=blocks precision=fp16{pipe}", rows, tflops, "TFLOP/s"))
    return out


def predicted(run: Run, estimate) -> float:
    """What the estimate says for ``run``'s measured column: seconds per iteration, or teraFLOP/s per
    GPU counted as the paper counts them (with the recomputation: Table 1)."""
    return estimate.step_s if run.unit == "s" else estimate.hardware_tflops_per_gpu


def check(runs: list[Run]) -> list[tuple[Run, float, float]]:
    """``(run, predicted, relative error)`` for each run, estimated as Megatron-LM ran it."""
    out = []
    for run in runs:
        plan = Plan.parse(run.plan)
        e = estimate(run.shape, plan, Cluster.preset(run.gpu, plan.world_size), batch=(run.rows, SEQ), stack="megatron")
        value = predicted(run, e)
        out.append((run, value, value / run.value - 1))
    return out
