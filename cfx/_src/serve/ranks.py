"""Every rank of a process-per-rank mesh steps the engine; rank 0 alone schedules: ``Control``.

Under torchrun (the ``dist`` mesh backend) each process holds its heads' weights and KV pool, and
each must run every step's forward with the same inputs, in the same order, for the tensor-parallel
collectives inside it to meet. Rank 0 owns the engine's scheduler, block allocator and sampler (and,
in ``python -m cfx.serve``, the HTTP server); before each thing it does to the pools -- a step's
forward, copies of blocks written by a fork -- it broadcasts the inputs (integer tensors: token ids,
positions, block tables) on a gloo group of its own, and the other ranks, looping in
``follow(engine)``, do the same with them until rank 0 calls ``stop_followers(engine)``. The logits
are gathered over the ``model`` axis, so only rank 0 needs them; sampling never leaves rank 0, so
nothing about a request's randomness has to agree across processes.

The group waits as long as the server idles (a week; a follower blocks in the broadcast between
requests, spending no CPU), and ``stop`` ends the followers' loops; a rank 0 that dies takes the
others down through torchrun, which stops the job when one worker fails.
"""
from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

IDLE = datetime.timedelta(days=7)


def needed(mesh: Any) -> bool:
    """Whether ``mesh`` runs its ranks as processes of their own (followers to lead)."""
    return mesh is not None and mesh.backend.name == "dist" and mesh.size > 1


class Control:
    """The leader's broadcasts to the other ranks (module doc). Made on every rank at once (a
    collective: ``new_group``). A message is a kind and integer tensors (or None): a fixed-size header of
    their shapes, then their elements in one flat tensor -- nothing pickled."""

    KINDS = ("stop", "copy", "rows")
    HEADER = 32  # int64s: the kind, the count, then each tensor's ndim (-1: None) and dims

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE)
        self.rank = dist.get_rank()
        self.leader = self.rank == 0

    def send(self, kind: str, *tensors: torch.Tensor | None) -> None:
        """Rank 0: ``kind`` and ``tensors`` to every other rank's ``recv``."""
        head = [self.KINDS.index(kind), len(tensors)]
        for t in tensors:
            head += [-1] if t is None else [t.dim(), *t.shape]
        assert len(head) <= self.HEADER, head  # (a step's six tensors take 17)
        header = torch.zeros(self.HEADER, dtype=torch.long)
        header[:len(head)] = torch.tensor(head)
        dist.broadcast(header, 0, group=self.group)
        flat = [t.reshape(-1).long() for t in tensors if t is not None]
        if sum(t.numel() for t in flat):
            dist.broadcast(torch.cat(flat), 0, group=self.group)

    def recv(self) -> tuple:
        """The other ranks: ``(kind, *tensors)`` as rank 0 sent them."""
        header = torch.empty(self.HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        head = header.tolist()
        shapes, at = [], 2
        for _ in range(head[1]):
            n = head[at]
            shapes.append(None if n < 0 else tuple(head[at + 1:at + 1 + n]))
            at += 1 + max(n, 0)
        flat = torch.empty(sum(math.prod(s) for s in shapes if s is not None), dtype=torch.long)
        if flat.numel():
            dist.broadcast(flat, 0, group=self.group)
        out, at = [], 0
        for shape in shapes:
            if shape is None:
                out.append(None)
                continue
            n = math.prod(shape)
            out.append(flat[at:at + n].reshape(shape))
            at += n
        return (self.KINDS[head[0]], *out)


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
