"""``cfx.parallel.estimate(model, plan, cluster, batch=(rows, seq))``: a training step's time, MFU and
memory per GPU on a cluster one does not have.

Memory: the model state (params, gradients, optimizer, ZeRO-3's gathered block, offload's copies) is
the plan's own accounting (``plan.build.account``, what ``Plan.describe`` prints and the step holds),
computed on shapes for the plan's mesh; activations are Korthikanti et al.'s terms for the plan's
tensor / sequence parallelism and remat (``workload``), times the microbatches the plan's pipeline
schedule keeps in flight (its own ``peak_in_flight``). With ``rehearse=True`` the step itself runs on
shapes for every rank (``Plan.describe(batch=)``): its activations' peak and the bytes each collective
sends per axis are then the step's own, as ``cfx.comm_stats`` counts them in the real step, and every
collective call it makes is timed on its axis's link.

Time: each layer's matmuls, attention core and memory-bound kernels on the GPU (``Gpu``), the
collectives each strategy issues per layer and per step on the link its mesh axis crosses (a mixture
of experts over an ``expert`` axis: each layer's routed rows to their experts' ranks and back, forward
and backward, the experts' weights split over it and the rest's gradients averaged over it; a 2D /
2.5D / 3D grid: every collective its own step sends, read from that step rehearsed at the model's widths
for one rank, ``grid_time``; ranks
are numbered with the plan's last mesh axis fastest, nodes hold consecutive ranks), the pipeline's
schedule run by ``cfx.pipeline``'s simulator with those per-stage costs (its bubble), then the
gradients' reduction over ``data``, the optimizer step and offload's traffic. Nothing here is
overlapped that the cfx step does not overlap (``overlap_dp=True`` for peers that do).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from cfx._src.core.text import format_bytes, format_table
from cfx._src.estimate import constants as C
from cfx._src.estimate.cluster import Cluster
from cfx._src.estimate.grid_time import grid_records
from cfx._src.estimate.links import Links, collective_s
from cfx._src.estimate.schedule_time import in_flight, makespan
from cfx._src.estimate.state_traffic import offload_s, zero3_s
from cfx._src.estimate.workload import TransformerShape
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.models.parts import max_length
from cfx._src.optim.alias import adamw
from cfx._src.plan.build import account, check_model
from cfx._src.plan.config import PRECISIONS

PRECISION = {"fp32": ("fp32", 4), "bf16": ("bf16", 2), "fp16": ("fp16", 2),
             **{p: ("fp8", 2) for p in PRECISIONS if p.startswith("fp8")}}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One plan's predicted training step on one cluster (module doc). ``breakdown``: seconds by item
    (compute by kind, collectives per axis, the pipeline's bubble, the optimizer, offload), as they
    add up on the critical path; ``memory``: per-GPU device bytes by kind."""

    plan: str
    cluster: str
    gpus: int
    batch: tuple[int, int]
    step_s: float
    model_flops: float
    hardware_flops: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    memory_bytes: int
    memory: dict[str, int]
    capacity: int
    breakdown: dict[str, float]
    # ``rehearse=True``: per mesh axes and phase, the payload bytes one rank hands to collectives in a step (the
    # most of any rank), from the step's own code run on shapes (``Plan.describe(batch=)``: ``cfx.comm_stats``'
    # figures of the real step); else empty
    collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting recomputation (Narayanan et al.'s figure under full recomputation)."""
        return self.hardware_flops / self.step_s / self.gpus / 1e12

    @property
    def tokens_per_s(self) -> float:
        return self.batch[0] * self.batch[1] / self.step_s

    def __str__(self) -> str:
        head = (f"{self.plan} on {self.cluster}, batch {self.batch[0]} x {self.batch[1]}: step {self.step_s:.3g} s, "
                f"{self.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {self.mfu:.1%} (HFU {self.hfu:.1%}), "
                f"{format_bytes(self.memory_bytes)} of {format_bytes(self.capacity)} per GPU"
                f"{'' if self.fits else ' -- does not fit'}")
        time_rows = [(k, f"{v:.4g}", f"{v / self.step_s:.1%}") for k, v in self.breakdown.items() if v > 0]
        mem_rows = [(k, format_bytes(v)) for k, v in self.memory.items() if v > 0]
        return "\n".join([head, "", format_table(time_rows, ["time", "seconds", "share"]), "",
                          format_table(mem_rows, ["memory per GPU", "bytes"])])


def estimate(model: Any, plan: Any, cluster: Cluster, *, batch: tuple[int, int], tx: Any = None,
             stack: str = "cfx", overlap_dp: bool = False, rehearse: bool = False) -> Estimate:
    """The step of ``plan`` training ``model`` on ``cluster`` with a global ``batch`` of ``(rows, seq)``
    (module doc). ``model``: a cfx decoder (its state then the plan's own accounting) or a bare
    ``TransformerShape`` shape. ``stack``: whose code runs the step, ``"cfx"`` or ``"megatron"`` (Megatron-LM
    as the papers ran it: ``constants.STACKS``); ``overlap_dp``: the gradients' reduction hidden behind
    backward (peers that overlap it). ``tx``: the optimizer whose state the plan accounts (AdamW).
    ``rehearse``: take the memory and the collectives from the step itself run on shapes for every rank
    (``Plan.describe(model, batch=)``: exactly what the step holds and sends, on a mesh of a few ranks; seconds
    for a small model, too slow for a search) instead of Korthikanti's activation terms, and time each
    collective call it makes (``_Step.records_s``) instead of the per-layer model's few."""
    if rehearse and isinstance(model, TransformerShape):
        raise ValueError("cfx.parallel.estimate: rehearse=True runs the plan's step on shapes and needs a cfx model "
                         f"(cfx.models.gpt2(...), ...), not the bare shape {model}; drop rehearse= for a shape.")
    shape = TransformerShape.of(model) if not isinstance(model, TransformerShape) else model
    rows, seq = batch
    if plan.world_size != cluster.gpus:
        raise ValueError(f"cfx.parallel.estimate: the plan {str(plan)!r} spans {plan.world_size} ranks and the "
                         f"cluster {cluster} has {cluster.gpus} GPUs; use a plan whose mesh multiplies to "
                         f"{cluster.gpus} (or Cluster.with_gpus({plan.world_size})).")
    if stack not in C.STACKS:
        raise ValueError(f"cfx.parallel.estimate: stack={stack!r}; use one of {', '.join(C.STACKS)}.")
    plan.check_batch(rows, seq)
    check_length(model, seq)
    state = None if isinstance(model, TransformerShape) else model_state(plan, model, tx)
    step = _Step(shape, plan, cluster, rows, seq, C.STACKS[stack])
    memory, collectives = step_memory(step, state), {}
    if rehearse:  # the plan's own figures: what describe prints, what comm_stats counts of the real step
        described = plan.describe(model, tx, batch=batch)
        memory = {k: v for k, v in described.bytes.items() if described.tiers[k] == "device"}
        collectives = described.collectives
        step.rehearsed = step.records_s(described.records)
    breakdown = step.times(overlap_dp, state)
    total = sum(breakdown.values())
    model_flops = shape.model_flops(rows, seq)
    hardware = model_flops + recompute_flops(shape, plan, rows, seq)
    peak = cluster.gpu.peak(step.hp) * cluster.gpus  # (fp8: MFU against bf16's peak, as torchtitan reports it)
    return Estimate(str(plan), str(cluster), cluster.gpus, (rows, seq), total, model_flops, hardware,
                    model_flops / total / cluster.gpus / 1e12, model_flops / total / peak, hardware / total / peak,
                    int(sum(memory.values())), memory, int(cluster.gpu.memory), breakdown, collectives)


def recompute_flops(shape: TransformerShape, plan: Any, rows: int, seq: int) -> float:
    """The FLOPs a step's remat computes again: whole layers (``blocks``), the attention core (``dots``)."""
    mm, attn = shape.layer_flops(rows * seq, seq)
    if plan.remat in ("blocks", "auto"):
        return shape.layers * (mm + attn)
    return shape.layers * attn if plan.remat == "dots" else 0.0


def check_length(model: Any, seq: int) -> None:
    """ValueError where ``seq`` is longer than the positions ``model`` takes (``max_length``)."""
    limit = None if isinstance(model, TransformerShape) else max_length(model)
    if limit is not None and seq > limit:
        name = model.max_len_name
        raise ValueError(f"cfx.parallel.estimate: sequences of {seq} positions are longer than "
                         f"{type(model).__name__}'s {name}={limit}; build the model with {name}={seq} (python -m "
                         f"cfx.plan: --preset NAME,{name}={seq}) or estimate a shorter --seq.")


def model_state(plan: Any, model: Any, tx: Any = None) -> Any:
    """The plan's own per-rank accounting of ``model``'s state (``Plan.describe``'s), on shapes."""
    check_model(plan, model)
    return account(plan, model, tx if tx is not None else adamw(1e-3), AbstractMesh(plan.mesh_shape or {"data": 1}))


class _Step(Links):
    """One step's parts for one plan (sizes per rank; links per axis: ``Links``)."""

    def __init__(self, shape: TransformerShape, plan: Any, cluster: Cluster, rows: int, seq: int, stack: dict):
        super().__init__(plan, cluster)
        self.shape, self.seq, self.stack = shape, seq, stack
        self.fused = stack["attention"] == "flash"
        self.dtype, self.bytes = PRECISION[plan.precision]
        self.hp = "bf16" if self.dtype == "fp8" else self.dtype  # (fp8: the layers' matmuls; the rest in bf16)
        self.gpu = cluster.gpu
        self.t = plan.size("model")
        self.sp = plan.sp == "megatron"
        self.cp = plan.size("seq")
        self.p = plan.size("pipe")
        self.v = plan.chunks if self.p > 1 else 1
        self.e = plan.size("expert")
        self.dp = plan.size("data") * self.e
        self.m = plan.microbatches if self.p > 1 else 1
        self.mb = rows // self.dp // self.m            # rows per microbatch on a rank
        self.tokens = self.mb * seq // self.cp           # its tokens on a rank
        self.per_chunk = math.ceil(shape.layers / (self.p * self.v))  # layers of the fullest chunk: it sets the pace
        self.rehearsed: dict[str, float] | None = None  # seconds per axis of a rehearsed step's collectives
        self.comm_scale: dict[str, float] = {}
        self.grid = None
        if plan.tp is not None:  # a 2D / 2.5D / 3D grid splits every matmul, and all between them, over its ranks
            self.t = math.prod(plan.size(a) for a in ("row", "col", "dep"))
            self.sp = True
            self.grid = grid_records(shape, plan, rows // self.dp, seq)

    # -- one layer, one microbatch ----------------------------------------------------------------------
    @functools.cached_property
    def layer(self) -> dict[str, float]:
        """Seconds of one layer's forward on one microbatch by kind, and its backward's and recomputation's."""
        sh, g, t = self.shape, self.gpu, self.t
        mm, attn = sh.layer_flops(self.tokens, self.seq)
        mm, attn = mm / t, attn / t
        gemms = 4 + (1 if sh.gated else 0)
        mm_s = g.matmul_s(mm / gemms, self.dtype, gemms)
        attn_eff = g.attention if self.fused else g.attention_unfused
        attn_s = (attn * (0.5 if self.fused else 1.0)) / (g.peak(self.hp) * attn_eff)
        mem_s = g.memory_s(sh.memory_bound_bytes(self.mb, self.seq, t=t, sp=self.sp, cp=self.cp, dtype=self.bytes,
                                                 fused=self.fused), kernels=8)
        cast_f = cast_b = 0.0
        if self.dtype == "fp8":  # each Linear's operands cast to float8
            f, b = sh.fp8_cast_bytes(self.tokens, t, self.bytes, self.plan.precision.endswith("gw_hp"))
            k = 7 if sh.gated else 6  # (the Linears of a layer)
            cast_f, cast_b = g.memory_s(f, kernels=2 * k), g.memory_s(b, kernels=3 * k)
        act = self.tokens * sh.hidden * self.bytes       # one (b, s, h) activation on this rank
        tp = 2 * self.collective("model", "all_reduce", act) if t > 1 and self.grid is None else 0.0  # Megatron's two
        grid = self.phases_s(self.grid.layer) if self.grid is not None else (0.0, 0.0)  # points (SP: the same bytes)
        seq = 0.0
        if self.cp > 1:
            if self.plan.sp == "ring":                   # K and V passed round the ring
                seq = (self.cp - 1) * self.collective("seq", "p2p", 2 * self.tokens * sh.kv_dim / t * self.bytes)
            else:                                        # Ulysses: q, k, v in, the output back
                seq = 4 * self.collective("seq", "all_to_all", act / t)
        tp, seq = tp * self.comm_scale.get("model", 1.0), seq * self.comm_scale.get("seq", 1.0)
        moe = moe_sizes = 0.0
        if sh.experts and self.e > 1:  # (token, expert) rows to their experts' ranks and back: ragged all-to-alls
            rows = self.collective("expert", "all_to_all", self.tokens * sh.top_k * sh.hidden * self.bytes)
            moe = 2 * rows                 # (the sizes exchanged first: one all-to-all of counts, forward only)
            moe_sizes = self.collective("expert", "all_to_all", 8 * sh.experts)
        fwd = {"matmul": mm_s, "attention": attn_s, "memory-bound": mem_s + cast_f, "model": tp + grid[0], "seq": seq,
               "expert": moe + moe_sizes}
        gw_s = g.matmul_s(mm / gemms, self.hp, gemms) if self.plan.precision.endswith("gw_hp") else mm_s
        bwd = {"matmul": mm_s + gw_s, "attention": (2.5 if self.fused else 2.0) * attn_s, "memory-bound": 2 * mem_s + cast_b,
               "model": (tp if not self.stack["tp_backward_overlap"] or self.sp else 0.0) + grid[1], "seq": 2 * seq,
               "expert": moe}
        remat = self.plan.remat
        if remat in ("blocks", "auto"):
            re = dict(fwd, model=tp)  # (a grid's recomputed collectives: in its rehearsed backward already)
        elif remat == "dots":                            # Megatron's selective: the attention core again
            sq = 0.0 if self.fused else g.memory_s(self.shape.heads / t * self.mb * (self.seq / self.cp) * self.seq
                                                     * self.bytes * 2)
            re = {"attention": attn_s, "memory-bound": sq}
        else:
            re = {}
        return {"fwd": fwd, "bwd": bwd, "re": re}

    def head(self) -> tuple[float, float]:
        """Forward and backward seconds of the logits and the loss (the last stage), the embedding (the first)."""
        sh, g = self.shape, self.gpu
        split = self.plan.grid_rows if self.grid is not None else self.t  # (a grid's head: replicated, its rows split)
        flops = 2.0 * self.tokens * sh.hidden * sh.vocab / split
        mm = g.matmul_s(flops, self.hp)
        ce = g.memory_s(3 * 4 * self.tokens * sh.vocab / split, kernels=3)  # fp32 logits: softmax, loss, grad
        emb = g.memory_s(2 * self.tokens * sh.hidden * self.bytes, kernels=2)
        return mm + ce + emb, 2 * mm + ce + emb

    # -- the step ---------------------------------------------------------------------------------------
    def times(self, overlap_dp: bool, state: Any) -> dict[str, float]:
        """The step's seconds by item (``Estimate.breakdown``): a pipeline's busiest rank's work by kind and
        the rest of its makespan as the bubble, then what follows backward. Rehearsed (``rehearsed``: seconds
        per axis of the step's own collectives), each layer's ``model`` and ``seq`` collectives are scaled so
        the rank's total is the rehearsal's (the calls the step makes, embedding and loss included) -- what is
        not inside a layer stays apart -- and ``data``'s is the rehearsal's (ZeRO's gathers and reductions)."""
        out = self._times(overlap_dp, state)
        if self.rehearsed is None:
            return out
        scale = {k: self.rehearsed.get(k, 0.0) / out[k] for k in ("model", "seq") if out.get(k, 0.0) > 0}
        if scale:
            self.comm_scale = scale
            self.__dict__.pop("layer", None)  # (a cached_property: recomputed with the scale)
            out = self._times(overlap_dp, state)
        for k in ("model", "seq"):
            if out.get(k, 0.0) == 0 and self.rehearsed.get(k, 0.0) > 0:
                out[f"{k} (outside the layers)"] = self.rehearsed[k]
        if not overlap_dp:
            out["data (gradients)"] = self.rehearsed.get("data", 0.0)
        return out

    def _times(self, overlap_dp: bool, state: Any) -> dict[str, float]:
        layer, sh = self.layer, self.shape
        per_layer = {k: layer["fwd"].get(k, 0) + layer["bwd"].get(k, 0) + layer["re"].get(k, 0)
                     for k in ("matmul", "attention", "memory-bound", "model", "seq", "expert")}
        f1 = sum(layer["fwd"].values())
        b1 = sum(layer["bwd"].values()) + sum(layer["re"].values())  # recomputation runs in backward
        hf, hb = self.head()
        out: dict[str, float] = {}
        per_chunk = self.per_chunk
        if self.p > 1:
            split = self.sp or self.stack["p2p_split"]
            send = self.collective("pipe", "p2p", self.tokens * sh.hidden * self.bytes / (self.t if split else 1))
            span = makespan(self.plan.schedule, self.p, self.m, self.v, per_chunk * f1, per_chunk * b1, hf, hb, send)
            layers_on_rank = per_chunk * self.v
            busy = self.m * (layers_on_rank * (f1 + b1))
            for k, v in per_layer.items():
                out[k] = self.m * layers_on_rank * v
            out["logits and loss"] = self.m * (hf + hb)
            out["pipeline bubble and sends"] = max(0.0, span - busy - out["logits and loss"])
        else:
            for k, v in per_layer.items():
                out[k] = sh.layers * v
            out["logits and loss"] = hf + hb
        if self.grid is not None:
            out["grid (embedding, head, loss)"] = sum(self.phases_s(self.grid.rest))
        out["data (gradients)"] = 0.0 if overlap_dp else self.data_reduce(state)
        out["optimizer"] = self.optimizer(state)
        out["offload traffic"] = offload_s(self, state)
        return out

    def state_bytes(self, state: Any, kind: str) -> float:
        """Per-rank bytes of ``kind``: the plan's accounting, or for a bare ``TransformerShape`` shape as that
        accounting counts a decoder's: fp32 params, as many gradient bytes, Adam's two moments, split over
        model x pipe, ZeRO's stages over data (biases and norms left out)."""
        if state is not None:
            return float(state.bytes.get(kind, 0))
        experts = self.shape.expert_params()
        n = (self.shape.params() - experts + experts / self.e) / (self.t * self.p)  # (experts split over expert)
        if self.grid is not None:  # a grid splits the blocks; the embedding and the head are replicated
            n = self.shape.layers * self.shape.layer_params() / self.t + self.shape.vocab * self.shape.hidden
        zero = self.plan.size("data") if self.plan.zero else 1
        params = 4 / (zero if self.plan.zero == 3 else 1)
        per = {"params": params, "grads": params, "optimizer": 8 / zero}
        return per[kind] * n

    def data_reduce(self, state: Any) -> float:
        """The gradients' reduction over ``data`` (and ZeRO's gathers): ZeRO 0 an all-reduce of the
        gradients, 1-2 a reduce-scatter and the params' all-gather (the same bytes), 3 the params gathered
        in forward and again in backward and the gradients reduce-scattered (cfx's in the compute dtype, with
        ``fp8_comm=all_gather`` the float8 weights in e4m3, with ``reduce_scatter`` the gradients as e5m2 in an
        all-to-all); then over ``expert``, the
        gradients it replicates (``expert_reduce``)."""
        if self.plan.size("data") == 1:
            return self.expert_reduce(state)
        n = self.plan.size("data")
        whole = self.state_bytes(state, "params") * (n if self.plan.zero == 3 else 1)  # a data rank's gradients
        if self.stack["grad_reduce_bytes"] is not None:  # a peer that reduces in its own dtype (constants.STACKS)
            whole *= self.stack["grad_reduce_bytes"] / 4
        if self.plan.zero == 3:
            out = zero3_s(self, whole)
        elif self.plan.zero == 0:
            out = self.collective("data", "all_reduce", whole)
        else:
            out = self.collective("data", "reduce_scatter", whole) + self.collective("data", "all_gather", whole)
        return out + self.expert_reduce(state)

    def expert_reduce(self, state: Any) -> float:
        """The gradients an expert axis replicates (all but the experts') averaged over it: an all-reduce."""
        if self.e == 1:
            return 0.0
        share = 1 - self.shape.expert_params() / self.e / (self.shape.params() - self.shape.expert_params()
                                                            + self.shape.expert_params() / self.e)
        grads = self.state_bytes(state, "params") * share
        if self.stack["grad_reduce_bytes"] is not None:
            grads *= self.stack["grad_reduce_bytes"] / 4
        return self.collective("expert", "all_reduce", grads)

    def optimizer(self, state: Any) -> float:
        """The optimizer step over the rank's shard: ``optimizer_bytes`` per parameter it updates (Adam's
        state is two floats per parameter); on the host under offload, where PCIe is what it costs."""
        if self.plan.home != "device":
            return 0.0
        n = self.state_bytes(state, "optimizer") / 8
        return self.gpu.memory_s(n * self.stack["optimizer_bytes"], kernels=4)


def step_memory(step: "_Step", state: Any) -> dict[str, int]:
    """Per-GPU device bytes by kind (module doc): the plan's accounting of the state (or a shape's, as it
    counts one), the activations the schedule keeps in flight, the fp32 logits."""
    sh = step.shape
    out: dict[str, int] = {}
    if state is not None:
        for k, v in state.bytes.items():
            if state.tiers.get(k, "device") == "device":
                out[k] = int(v)
    else:
        for k in ("params", "grads", "optimizer"):
            out[k] = int(step.state_bytes(None, k))
        if step.plan.zero == 3 and step.plan.size("data") > 1:   # ZeRO-3 gathers one layer at a time
            out["gathered block"] = int(4 * sh.layer_params() / step.t)
    remat = "blocks" if step.plan.remat == "auto" else step.plan.remat
    per_layer = sh.activation_bytes(step.mb, step.seq, t=step.t, sp=step.sp, cp=step.cp, dtype=step.bytes,
                                    fused=step.fused, remat=remat)
    held = in_flight(step.plan.schedule, step.p, step.m, step.v) if step.p > 1 else 1
    out["activations"] = int(held * step.per_chunk * per_layer)
    if remat == "blocks":   # one layer's own activations while it is recomputed
        out["activations"] += int(sh.activation_bytes(step.mb, step.seq, t=step.t, sp=step.sp, cp=step.cp,
                                                      dtype=step.bytes, fused=step.fused))
    split = step.plan.grid_rows if step.grid is not None else step.t
    out["logits"] = int(2 * 4 * step.tokens * sh.vocab / split)  # fp32 logits and their gradient
    return out
