"""Gemini placement for ZeRO-3: the largest GPT-2 that trains under a device budget, per policy.

The device here is ``cfx.memory``'s accounting tier (this machine has no accelerator): the
engine's device store (chunk copies, and for ``device`` the whole model state), gathered payloads
and every op output of forward and backward (``track_ops``) count against the budget. For each
policy (``device``, ``host``, ``auto(B)``, ``host`` + NVMe files), GPT-2 shapes are tried from
small to large; the largest whose tracked device peak stays <= B over two steps is reported,
with its step time and its chunks (the layers' shards packed into equal-size chunks, the size
chosen by ``search_chunk_size`` for the least padding: "chunk size" and "chunk waste"). Traffic: host<->device bytes per step as a ratio to ZeRO-Offload's minimum
(this rank's params partition down once + its gradients up once: 4M/N bytes per rank for M
fp16 params; 8M/N here, fp32). Step
times of all policies are also given at one common size (the largest ``device`` manages).
"""
from __future__ import annotations

import shutil
import tempfile
import time

import torch

import cfx
from cfx import P
from cfx import zero
from cfx.bench.common import Row, report, size_of

MiB = 1 << 20
N = 2  # ranks


LADDERS = {  # size -> ([(n_embd, n_layer)], vocab, T, batch per rank, device budget)
    "smoke": ([(32, 1), (64, 1)], 64, 8, 1, 1 * MiB),
    "quick": ([(64, 2), (128, 2), (192, 3), (256, 4), (384, 4)], 512, 32, 2, 16 * MiB),
    "full": ([(128, 4), (256, 8), (512, 8), (768, 12)], 8192, 128, 2, 512 * MiB),
}


def train(shape, vocab, T, batch, placement, *, n=N, steps=2):
    """(device peak bytes, last step seconds, host<->device bytes per step, params, the chunk search)."""
    C, L = shape
    model = cfx.models.gpt2("tiny", n_layer=L, n_embd=C, n_head=max(1, C // 64), vocab_size=vocab, n_positions=T)
    net = zero.gathered(model.map_blocks(lambda b: zero.gathered(b, axis="data")), axis="data")
    tokens = cfx.random.randint(cfx.random.key(1), (steps, batch * n, T + 1), 0, vocab)

    searches = []

    def body(params, tokens):
        times = []
        with cfx.memory.track() as mem:  # from before the engine: its stores count from the start
            engine = zero.GeminiEngine(net, zero.shard_params(params, axis="data"), cfx.optim.adamw(1e-3),
                                       axis="data", offload=placement)
            searches.append(engine.chunk_search)
            for t in tokens:
                t0 = time.perf_counter()
                with mem.track_ops("device"):
                    engine.backward(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))
                engine.update()
                times.append(time.perf_counter() - t0)
        moved = engine.traffic["host->device"] + engine.traffic["device->host"]
        return torch.tensor([[mem.peak("device", rank=cfx.lax.axis_index("data")), times[-1], moved / steps]])

    params = model.init(cfx.random.key(0))
    with cfx.Mesh({"data": n}) as mesh:
        out = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P("data"))(
            params, tokens))
    peak, seconds, moved = out.max(0).values.tolist()
    return peak, seconds, moved, cfx.tree.size(params), searches[0]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    ladder, vocab, T, batch, budget = LADDERS[size_of(quick=quick, smoke=smoke)]
    nvme_dir = tempfile.mkdtemp(prefix="cfx-bench-nvme-")
    policies = {"device": zero.offload(cfx.gemini.device()), "host": zero.offload(cfx.gemini.host()),
                "auto": zero.offload(cfx.gemini.auto(budget)),
                "nvme": zero.offload(cfx.gemini.host(), nvme_dir=nvme_dir)}
    rows, largest, common = [], {}, None
    try:
        for name, placement in policies.items():
            best = None
            for shape in ladder:
                try:
                    peak, seconds, moved, psi, search = train(shape, vocab, T, batch, placement)
                except ValueError:  # auto: the budget cannot hold this size
                    break
                if peak > budget:
                    break
                best = (shape, peak, seconds, moved, psi, search)
            largest[name] = best
            if best is None:
                rows.append(Row(f"{name}: no GPT-2 of the ladder trains under {budget // MiB} MiB", 0, "params",
                                "> 0", False))
                continue
            shape, peak, seconds, moved, psi, search = best
            top = " (ladder top)" if shape == ladder[-1] else ""
            rows.append(Row(f"{name}: largest GPT-2 under {budget // MiB} MiB device: {shape[1]}x{shape[0]}{top}",
                            psi, "params", f"device peak {peak / MiB:.1f} <= {budget // MiB} MiB", peak <= budget))
            rows.append(Row(f"{name}: step time at that size", seconds, "s"))
            rows.append(Row(f"{name}: chunk size at that size ({search.n_chunks} chunks of fp32 elements/rank)",
                            search.size, "elements"))
            rows.append(Row(f"{name}: chunk waste (padding, least over {search.n_candidates} candidate sizes)",
                            100 * search.waste_fraction, "%", f"{search.waste} elements"))
            if name != "device":
                least = 2 * 4 * psi / N  # this rank's params down once, its gradients up once
                rows.append(Row(f"{name}: host<->device bytes/step/rank / ZeRO-Offload minimum (2 x 4 Psi/N)",
                                moved / least, "x", ">= 1", moved >= least * 0.999))
        if largest.get("device"):
            common = largest["device"][0]
            for name, placement in policies.items():
                _, seconds, moved, psi, _ = train(common, vocab, T, batch, placement)
                rows.append(Row(f"{name}: step time at {common[1]}x{common[0]} ({psi / 1e6:.2f}M params)",
                                seconds, "s"))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    return report("gemini", rows, json_path)
