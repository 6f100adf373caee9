"""Gemini placement for ZeRO-3: the configuration, the layer groups, and the gathered layers' source.

A *group* is one gathered layer's params; this rank's shard of it (S,) (``flat``) is what the
layer all-gathers and reduce-scatters. A *chunk* is a flat buffer of equal-size packing of group
shards in execution order (``chunking``): the unit that is fetched to the device, evicted, moved
between tiers and stepped. ``offload(policy, nvme_dir=)`` says where chunks live and where the
optimizer step runs:

=========  ====================  =====================  ==========================
policy     param chunks (home)   on the device          grads, optimizer state/step
=========  ====================  =====================  ==========================
device     device                always                 device
host       host                  only while gathered    host
auto(B)    host                  Belady plan under B    host
+ nvme_dir NVMe files            as the policy says     grads host, optimizer NVMe
=========  ====================  =====================  ==========================

A device copy of a chunk is a cache of its home copy (params only change in the optimizer step),
so evicting it moves no bytes. ``auto`` measures a warm-up step (the first): per chunk access,
the device bytes that are not chunks (gathered payloads, activations, gradients in flight), then
plans evictions with ``cfx.gemini.plan_auto`` and checks the budget against the measurement.
"""
from __future__ import annotations

import weakref

import dataclasses
import os
from typing import Any

import torch

from cfx._src.gemini.policy import AutoPolicy, DevicePolicy, HostPolicy
from cfx._src.gemini.store import NvmeStore
from cfx._src.zero.gathered import Gathered, _under, gathered_children, sublayer_at
from cfx._src.zero.source import ShardSource


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where ZeRO-3 chunks and optimizer state live (see the module doc)."""

    policy: Any
    nvme_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.policy, (DevicePolicy, HostPolicy, AutoPolicy)):
            raise ValueError(f"cfx.zero.offload: policy must be cfx.gemini.device(), host() or "
                             f"auto(device_budget_bytes), got {self.policy!r}.")
        if self.nvme_dir is not None:
            probe_nvme_dir(self.nvme_dir)

    @property
    def name(self) -> str:
        base = {DevicePolicy: "device", HostPolicy: "host", AutoPolicy: "auto"}[type(self.policy)]
        return base + ("+nvme" if self.nvme_dir is not None else "")

    @property
    def param_home(self) -> str:
        if self.nvme_dir is not None:
            return "nvme"
        return "device" if isinstance(self.policy, DevicePolicy) else "host"

    @property
    def optim_home(self) -> str:
        return self.param_home

    @property
    def grad_home(self) -> str:
        return "device" if self.param_home == "device" else "host"


def probe_nvme_dir(directory: str) -> None:
    """ValueError now (not mid-training) if ``directory`` cannot hold chunk files."""
    NvmeStore(directory, keep=True)  # creates the directory (kept), writes and removes a probe file, or raises


def offload(policy: Any, *, nvme_dir: str | os.PathLike | None = None) -> Offload:
    """A placement for ``GeminiEngine``: ``cfx.gemini.device()``, ``host()`` or ``auto(budget)``,
    with chunks and optimizer state in files under ``nvme_dir`` when given. Checked here, on
    the caller, before any training starts."""
    return Offload(policy, None if nvme_dir is None else os.fspath(nvme_dir))


def gather_groups(layer: Any, paths: list[str]) -> list[list[int]]:
    """Leaf indices per gathered layer of ``layer`` (own params only), in nesting order."""
    groups: list[list[int]] = []

    def walk(obj: Any, prefix: str) -> None:
        join = (lambda c: f"{prefix}.{c}" if prefix else c)
        if isinstance(obj, Gathered):
            children = gathered_children(obj.layer)
            kids = [join(c) for c in children]
            own = [i for i, p in enumerate(paths) if (not prefix or _under(p, [prefix])) and not _under(p, kids)]
            if own:
                groups.append(own)
            for c in children:
                walk(sublayer_at(obj.layer, c), join(c))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):  # a wrapper (remat, ...) shares its layer's params
                v = getattr(obj, f.name)
                if isinstance(v, Gathered) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
                    walk(v, prefix)

    walk(layer, "")
    seen = sorted(i for g in groups for i in g)
    if seen != list(range(len(paths))):
        missing = [paths[i] for i in range(len(paths)) if i not in set(seen)]
        raise ValueError(f"cfx.zero.GeminiEngine: params {missing[:4]} belong to no gathered layer; wrap "
                         "the model itself too: cfx.zero.gathered(model.map_blocks(lambda b: "
                         "cfx.zero.gathered(b, axis=...)), axis=...).")
    return groups


class ChunkSource(ShardSource):
    """A gathered layer's shard served by its slice of a ``GeminiEngine`` chunk, not params pieces."""

    def __init__(self, engine: Any, group: int, layout, axis: str):
        super().__init__(layout, axis, [], engine.dtype)
        self.engine, self.group = engine, group

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.engine.anchor,)

    def shard(self, *, backward: bool) -> torch.Tensor:
        return self.engine.acquire(self.group, backward=backward)

    def after_gather(self, *, backward: bool) -> None:
        self.engine.computing(self.group)

    def after_forward(self) -> None:
        self.engine.forward_done(self.group)

    def deliver(self, grad: torch.Tensor) -> tuple:
        self.engine.add_grad(self.group, grad)
        return (None,)


class ChunkRef:
    """What the engine puts in each ``ShardedLeaf.source``: one per group, shared by its leaves."""

    def __init__(self, engine: Any, group: int):
        # a proxy: the engine holds its refs, so a strong reference back would be a cycle that
        # keeps every chunk's tensors alive until the garbage collector happens to run
        self.engine, self.group = weakref.proxy(engine), group

    def for_layout(self, layout, axis: str, pieces: list) -> ChunkSource:
        del pieces  # None: the engine's chunks are the params
        self.engine.check_layout(self.group, layout, axis)
        return ChunkSource(self.engine, self.group, layout, axis)
