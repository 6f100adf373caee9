"""The ``dist`` backend: one process per rank (torchrun, or an initialised process group).

Every process makes the same groups in the same order at start-up (``new_group`` is collective
over the world), one per non-empty subset of mesh axes and slice, so a collective on any axis
tuple finds its group ready. ``run`` executes the body for this process's own rank and returns
its output only: nothing is exchanged outside the collectives the body issues (SPMD).

The first mesh of a process initialises the world if nobody has: gloo for CPU tensors and, where
CUDA is available, NCCL for CUDA tensors in the same groups (torch's ``"cpu:gloo,cuda:nccl"``), each
process on its ``LOCAL_RANK``'s device (``world_backend``), each attempt of a job torchrun restarts
on a rendezvous of its own (``init_world``). Closing a mesh releases
its groups but leaves the world up for the next mesh, because torch cannot re-initialise a world
on the same rendezvous store (the second world finds the first one's stale addresses there).
"""
from __future__ import annotations

import datetime
import itertools
from typing import Any, Callable

import os

import torch
import torch.distributed as dist

from cfx._src.mesh import context as ctx_lib


def world_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA and NCCL are there (one world,
    groups that route each tensor to its device's library)."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_world(backend: str, timeout: datetime.timedelta) -> None:
    """The world's process group. Under torchrun's agent store, each attempt of a job that torchrun
    restarts (``--max-restarts``) rendezvouses under a key prefix of its own: torch keeps the same
    store across attempts, so the restarted ranks would otherwise read the dead attempt's gloo
    addresses and time out connecting to them."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        dist.init_process_group(backend, timeout=timeout)
        return
    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    attempt = dist.PrefixStore(f"/cfx/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=attempt, rank=int(env["RANK"]), world_size=world, timeout=timeout)


class DistBackend:
    name = "dist"

    def __init__(self, mesh):
        self.mesh = mesh
        if not dist.is_initialized():
            backend = world_backend()
            if "nccl" in backend:  # a process per GPU: its collectives' CUDA tensors live there
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            init_world(backend, datetime.timedelta(seconds=mesh.timeout))
        world = dist.get_world_size()
        if world != mesh.size:
            raise ValueError(f"{mesh.shape} needs {mesh.size} ranks but the process group has {world}; "
                             f"launch with torchrun --nproc-per-node {mesh.size} or change the mesh.")
        self.rank = dist.get_rank()
        self.local_ranks = [self.rank]
        self._groups: dict[tuple[str, ...], ctx_lib.Group] = {}
        names = mesh.axis_names
        for k in range(1, len(names) + 1):
            for axes in itertools.combinations(names, k):  # mesh order
                seen = set()
                for r in range(mesh.size):
                    members = tuple(mesh.group_members(axes, r))
                    if members in seen:
                        continue
                    seen.add(members)
                    pg = dist.new_group(list(members), timeout=datetime.timedelta(seconds=mesh.timeout))
                    if self.rank in members:
                        self._groups[axes] = ctx_lib.Group(
                            axes, len(members), members.index(self.rank), pg, key=axes, members=members,
                            mesh=mesh, me=self.rank, check="fingerprints" if mesh.check_collectives else None)
        self._ctx = ctx_lib.RankContext(mesh, self.rank, mesh.coords(self.rank), self._groups.__getitem__)
        self._ctx.groups = dict(self._groups)
        self._closed = False

    def run(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        if self._closed:
            raise ValueError(f"{self.mesh!r} is closed; make a new Mesh.")
        with ctx_lib.installed(self._ctx):
            return {self.rank: fn(self.rank)}

    def close(self) -> None:
        """Wait for every rank and release this mesh's groups (the world stays up; module doc)."""
        if self._closed:
            return
        self._closed = True
        dist.barrier()
        for g in self._groups.values():
            if g.pg is not None and g.size > 1:
                dist.destroy_process_group(g.pg)
            g.pg = None
        self._ctx.groups.clear()
