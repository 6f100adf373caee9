"""``cfx.parallel.Cluster``: the machines a plan would run on, as data.

    cluster = Cluster.preset("h100-80gb", gpus=1024)     # 128 DGX H100 nodes
    Cluster.from_json(cluster.to_json()) == cluster

A cluster is one GPU kind (``Gpu``: dense peak FLOP/s per dtype, HBM bytes and bandwidth, what share of
those peaks its kernels sustain), how many GPUs, how many share a node, and three links per GPU: inside a
node (``intra``: NVLink), between nodes (``inter``: InfiniBand), to the host (``host``: PCIe), with the
node's NVMe bandwidth for ``offload=nvme``. The presets' constants and their sources are in
``constants.py``. ``Cluster.cpu(cost, gpus=N)`` is this machine as a cluster: the local mesh's ranks,
their matmul throughput, memory bandwidth and per-axis links from ``cfx.autoshard.calibrate``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from cfx._src.estimate import constants as C


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One accelerator kind: dense peak FLOP/s per compute dtype (``flops``), vector FLOP/s, HBM
    ``memory`` bytes and ``memory_bw`` bytes/s, and the share of those peaks kernels sustain (module
    doc of ``constants``): large matmuls (``matmul``, half of it at ``matmul_half`` FLOPs per GEMM),
    the attention core fused (``attention``) and as batched GEMMs (``attention_unfused``), memory-bound kernels (``memory_eff``), ``launch`` s per kernel."""

    name: str
    flops: dict[str, float]
    vector_flops: float
    memory: float
    memory_bw: float
    matmul: float
    matmul_half: float
    attention: float
    attention_unfused: float
    memory_eff: float
    launch: float

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ValueError(f"Gpu {self.name!r}: no peak for {dtype!r}; it has {sorted(self.flops)}.")
        return self.flops[dtype]

    def matmul_s(self, flops: float, dtype: str, count: int = 1) -> float:
        """Seconds of ``count`` GEMMs of ``flops`` each (their sustained share falls off below ``matmul_half``)."""
        if flops <= 0:
            return 0.0
        eff = self.matmul * flops / (flops + self.matmul_half)
        return count * (flops / (self.peak(dtype) * eff) + self.launch)

    def memory_s(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of memory-bound kernels moving ``nbytes`` (read + written) in all."""
        return nbytes / (self.memory_bw * self.memory_eff) + kernels * self.launch if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    """A link per GPU and direction: peak ``bandwidth`` bytes/s, the share NCCL's ring collectives
    reach (``efficiency``), ``latency`` s per ring step."""

    name: str
    bandwidth: float
    efficiency: float
    latency: float

    @property
    def busbw(self) -> float:
        return self.bandwidth * self.efficiency


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of one kind, ``gpus_per_node`` to a node, with their links (module doc)."""

    gpu: Gpu
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    host: Link
    nvme_bw: float  # bytes/s per node
    name: str = ""

    def __post_init__(self):
        for field in ("gpus", "gpus_per_node"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Cluster: {field}={v!r}; use a positive int.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"Cluster {self.name or self.gpu.name!r}: {self.gpus} GPUs do not fill nodes of "
                             f"{self.gpus_per_node}; use a multiple of {self.gpus_per_node}.")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def __str__(self) -> str:
        return f"{self.name or self.gpu.name}:{self.gpus}"

    # -- presets and text --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, gpus: int = 8) -> "Cluster":
        """A preset of ``constants.PRESETS`` (``a100-40gb``, ``a100-80gb``, ``h100-80gb``, ``h200``) with ``gpus``."""
        if name not in C.PRESETS:
            raise ValueError(f"Cluster.preset: unknown {name!r}; presets are {', '.join(C.PRESETS)} (or "
                             "Cluster.cpu(...) for this machine's calibrated local mesh).")
        p = C.PRESETS[name]
        g = C.GPUS[p["gpu"]]
        eff = C.EFFICIENCY[g["calibration"]]
        gpu = Gpu(p["gpu"], dict(g["flops"]), g["vector_flops"], g["memory"], g["memory_bw"], eff["matmul"],
                  eff["matmul_half"], eff["attention"], eff["attention_unfused"], eff["memory"], eff["launch"])
        links = {k: Link(p[k], **C.LINKS[p[k]]) for k in ("intra", "inter", "host")}
        return cls(gpu, gpus, p["gpus_per_node"], nvme_bw=p["nvme_bw"], name=name, **links)

    @classmethod
    def parse(cls, text: str) -> "Cluster":
        """``"h100-80gb:1024"`` (a preset and its GPU count), or a JSON file's path (``to_json``'s)."""
        name, _, n = text.partition(":")
        if name.endswith(".json"):
            with open(name) as f:
                return cls.from_json(f.read())
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--cluster {text!r}: expected PRESET:GPUS (e.g. h100-80gb:1024; presets "
                             f"{', '.join(C.PRESETS)}) or a cluster's JSON file.")
        return cls.preset(name, int(n))

    def with_gpus(self, gpus: int) -> "Cluster":
        return dataclasses.replace(self, gpus=gpus)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        d = json.loads(text)
        try:
            return cls(Gpu(**d["gpu"]), d["gpus"], d["gpus_per_node"], Link(**d["intra"]), Link(**d["inter"]),
                       Link(**d["host"]), d["nvme_bw"], d.get("name", ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"Cluster.from_json: not a cluster ({e}); write one with Cluster.to_json().") from None

    @classmethod
    def cpu(cls, cost: Any, gpus: int) -> "Cluster":
        """This machine's local mesh of ``gpus`` ranks as a cluster, from ``cfx.autoshard``'s measured
        ``CostModel`` (``calibrate``): one node whose every link is the slowest measured axis."""
        bw = cost.bandwidth if isinstance(cost.bandwidth, (int, float)) else min(cost.bandwidth.values())
        lat = cost.latency if isinstance(cost.latency, (int, float)) else max(cost.latency.values())
        # the cost model's bandwidth is bytes per rank per second of a collective step, latency per step
        link = Link("loopback", float(bw), 1.0, float(lat))
        flops = float(cost.flops_per_s)
        gpu = Gpu("cpu", {"fp32": flops, "bf16": flops, "fp16": flops, "fp8": flops}, flops, 24 * C.GB,
                  float(cost.memory_bandwidth) * 2, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0)
        return cls(gpu, gpus, gpus, link, link, Link("memcpy", gpu.memory_bw, 1.0, 0.0), 1 * C.GB, name="cpu")
