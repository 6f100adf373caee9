"""Offload (with ZeRO-3): the pieces, their gradients and the optimizer state live on the host
(``host``, ``auto``) or in files (``nvme``), and the gathered layers read their shards from Gemini
chunk copies on the device (``zero.placed``: one chunk at a time, or what ``auto``'s plan fits in
its budget). Each rank keeps its placement across steps (``auto``'s warm-up record)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import weakref
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.mapped import mapped_copy
from cfx._src.gemini.policy import auto as auto_policy, host as host_policy
from cfx._src.lax import collectives as lax
from cfx._src.mesh.context import current_or_none
from cfx._src.plan.strategy import Account, Built, Strategy
from cfx._src.precision import amp
from cfx._src.spmd.sharded import ShardedArray
from cfx._src.zero.offload import probe_nvme_dir
from cfx._src.zero.placed import Placement


def free_device_bytes(mesh) -> int:
    """offload=auto without a budget: the device memory free now, shared by this process's ranks
    (no bound on an ``AbstractMesh``: nothing runs there)."""
    if mesh.backend is None:
        return 1 << 62
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:  # a CPU-only machine: the device is host memory
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, free // len(mesh.local_ranks))


def make_placement(plan, local_model, layout, budget: int) -> Placement:
    """One rank's placement of its ZeRO-3 pieces for ``offload`` (``host`` and ``nvme``: a chunk at
    a time; ``auto`` within ``budget`` device bytes); ValueError if the budget cannot hold one chunk."""
    policy = auto_policy(budget) if plan.offload == "auto" else host_policy()
    return Placement(local_model, layout.local_abstract(), policy, home=plan.home,
                     dtype=amp.policy(plan.precision).compute_dtype, where=f"Plan {str(plan)!r}")


def nvme_home(plan, nvme_dir: str | None, owner: Any) -> str | None:
    """``offload=nvme``: the directory the state's files go to -- ``nvme_dir``, or a new temporary one
    removed with ``owner`` -- checked writable now (a ValueError); None for any other plan."""
    if plan.offload != "nvme":
        return None
    if nvme_dir is None:  # a directory of our own (its files are unlinked as they are made)
        nvme_dir = tempfile.mkdtemp(prefix="cfx-nvme-")
        weakref.finalize(owner, _remove_dir, nvme_dir)
    probe_nvme_dir(os.fspath(nvme_dir))
    return os.fspath(nvme_dir)


def _remove_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)


class Offload(Strategy):
    name = "offload"

    def check_plan(self, plan) -> None:
        if plan.offload != "none" and plan.zero != 3:
            raise ValueError(f"Plan: offload={plan.offload} places ZeRO-3 chunks (Gemini); it needs "
                             f"zero=3, not zero={plan.zero}.")
        if plan.offload_budget is not None and plan.offload != "auto":
            raise ValueError(f"Plan: only offload=auto takes a device budget, not offload={plan.offload}.")

    def prepare(self, plan, built: Built) -> None:
        """``offload=nvme``: the directory the state's files go to, made and checked now."""
        built.nvme_dir = nvme_home(plan, built.nvme_dir, built)

    def jit_refusal(self, plan) -> str | None:
        return f"offload={plan.offload} moves chunks between tiers in Python" if plan.offload != "none" else None

    def runner(self, plan, inner: Any, built: Built) -> Any:
        if plan.offload == "none":
            return inner
        placements = built.shared.setdefault("placements", {})  # per rank, kept across the program's builds

        def new() -> Placement:
            return make_placement(plan, built.local, built.layout, plan.offload_budget or free_device_bytes(built.mesh))
        new()  # on shapes now: a budget below one chunk fails before any rank runs
        return PlacedRunner(inner, new, placements, tuple(a for a in ("data", "expert", "seq", "model") if plan.has(a)))

    def place_frozen(self, plan, placer, model) -> Any:
        """Frozen weights at the state's home: host memory (``host``, and ``auto``, whose chunks' home is
        the host too) or files in the program's directory (``nvme``)."""
        if plan.offload == "none":
            return placer
        if plan.offload == "nvme" and placer.nvme_dir is None:
            raise ValueError(f"Plan {str(plan)!r}: offload=nvme keeps the frozen weights in files; pass the directory "
                             "(nvme_dir=) the plan's program writes its own into.")
        return dataclasses.replace(placer, home="nvme" if plan.offload == "nvme" else "host")

    def place_state(self, plan, state: Any, built: Built) -> Any:
        """``offload=nvme``: every block of the state moved into a file (``gemini.mapped``); the step
        writes into those blocks (donation), so the state stays there."""
        if built.nvme_dir is None:
            return state
        return tree_util.map(lambda a: ShardedArray(a.shape, a.spec, a.mesh, {
            r: mapped_copy(b, built.nvme_dir) for r, b in a.blocks.items()}), state)

    def account(self, plan, acc: Account, built: Built) -> None:
        """The model state at home (host or files); the device holds chunk copies: one chunk at a time
        (``host``, ``nvme``), at most the budget's (``auto``)."""
        if plan.offload == "none":
            return
        budget = plan.offload_budget or 1 << 62
        placement = make_placement(plan, built.local, built.layout, budget)
        chunks = placement.chunk_bytes
        acc.add("device chunks", chunks[0] if plan.offload in ("host", "nvme") else min(sum(chunks), budget))
        if plan.size("pipe") > 1 and plan.microbatches > 1:
            # a later microbatch's gradient piece of a layer arrives at home (``Placement.deliver``) beside the
            # sum of the earlier ones, then is added into it: one layer's piece more at the peak
            pieces = [x for _, x in tree_util.flatten_with_path(built.layout.local_abstract().pieces)[0]]
            arriving = max(sum(pieces[i].shape[0] * pieces[i].dtype.itemsize for i in g) for g in placement.groups)
            acc.add("grads", acc.bytes["grads"] + arriving, acc.tiers["grads"])


class PlacedRunner:
    """``inner`` with each rank's pieces read from its placement's chunk copies (cast to the compute
    dtype; the pieces stay as stored); ``agree`` over the axes whose ranks run the same accesses."""

    def __init__(self, inner: Any, new: Any, placements: dict, agree: tuple[str, ...]):
        self.inner, self.new, self.placements, self.agree = inner, new, placements, agree

    def placement_of(self, rank: int) -> Placement:
        if rank not in self.placements:
            self.placements[rank] = self.new()
        return self.placements[rank]

    def grads(self, local: Any, batch: tuple, key: Any, scale: Any, view: Any) -> tuple[Any, Any]:
        placement = self.placement_of(current_or_none().rank)
        agree = self.agree
        with placement.step(local, agree=lambda v: lax.pmax(v, agree) if agree else v):
            return self.inner.grads(local, batch, key, scale, placement.tree)

    def loss(self, local: Any, batch: tuple) -> Any:
        return self.inner.loss(local, batch)
