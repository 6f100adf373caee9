"""Every rank of a process-per-rank mesh steps the engine; rank 0 alone schedules: ``Control``.

Under torchrun (the ``dist`` mesh backend) each process holds its heads' weights and KV pool, and
each must run every step's forward with the same inputs, in the same order, for the tensor-parallel
collectives inside it to meet. Rank 0 owns the engine's scheduler, block allocator and sampler (and,
in ``python -m cfx.serve``, the HTTP server); before each thing it does to the pools -- a step's
forward, copies of blocks written by a fork -- it broadcasts the inputs on a gloo group of its own,
and the other ranks, looping in ``follow(engine)``, do the same with them until rank 0 calls
``stop_followers(engine)``. The logits are gathered
over the ``model`` axis, so only rank 0 needs them; sampling never leaves rank 0, so nothing about a
request's randomness has to agree across processes.

The group waits as long as the server idles (a week; a follower blocks in the broadcast between
requests, spending no CPU), and ``stop`` ends the followers' loops; a rank 0 that dies takes the
others down through torchrun, which stops the job when one worker fails.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

IDLE = datetime.timedelta(days=7)


def needed(mesh: Any) -> bool:
    """Whether ``mesh`` runs its ranks as processes of their own (followers to lead)."""
    return mesh is not None and mesh.backend.name == "dist" and mesh.size > 1


class Control:
    """The leader's broadcasts to the other ranks (module doc). Made on every rank at once (a
    collective: ``new_group``)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE)
        self.rank = dist.get_rank()
        self.leader = self.rank == 0

    def send(self, *msg: Any) -> None:
        """Rank 0: ``msg`` to every other rank's ``recv``."""
        dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def leads(engine: Any) -> bool:
    """Whether this process schedules and samples ``engine``'s requests: without a mesh of processes, always;
    with one, rank 0 alone; the others ``follow``."""
    control = engine.run.control
    return control is None or control.leader


def follow(engine: Any) -> None:
    """A rank other than 0: run every step rank 0's engine runs -- its forwards and block copies, on this rank's
    heads and KV pool -- until rank 0 calls ``stop_followers``."""
    if leads(engine):
        raise ValueError("cfx.serve.follow: for the ranks other than 0 of a torchrun mesh; this process schedules "
                         "(call engine.step(), or serve it).")
    with torch.inference_mode():
        engine.run.follow(engine.pools)


def stop_followers(engine: Any) -> None:
    """Rank 0: end the other ranks' ``follow`` (when it serves no more); nothing without followers."""
    control = engine.run.control
    if control is not None and control.leader:
        control.send("stop")
