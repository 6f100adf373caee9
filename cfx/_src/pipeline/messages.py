"""The messages one rank's pipeline step exchanges with its neighbours: activations forward
(``SEND_F`` / ``RECV_F``) and their gradients backward (``SEND_B`` / ``RECV_B``), for ``run.Run``.

Each message has a tag of its own (family, stage, microbatch) and one spec, the activations'
shape, dtype and device -- or, where the step sends its activations in float8 (``fp8``: a Plan's
``fp8_comm=pipe``), an activation goes as its e4m3 cast by its own amax, then its fp32 scale's four
bytes (``packed``: one byte an element where bf16 takes two), and the receiver computes on the cast
divided by the scale (``unpacked``); gradients go back as they are. Sends never wait (their handles are reaped as they complete, and waited
for at the end). Receives are posted one ahead: while this rank computes, the next message it
will read can already move (gloo moves a message only once its receive is posted), so a RECV
action mostly finds its bytes arrived instead of starting the transfer. One message buffer more.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Iterable

import torch

from cfx._src.lax import collectives as lax
from cfx._src.nn.fp8 import E4M3, scale_of, to_fp8

RECVS = ("RECV_F", "RECV_B")  # indexed by message family (the tag's first part)


def packed(t: torch.Tensor) -> torch.Tensor:
    """``t``'s e4m3 cast (by its amax, saturating) as bytes, then its fp32 scale's four bytes."""
    with torch.no_grad():
        scale = scale_of(t, E4M3)
        return torch.cat([to_fp8(t, E4M3, scale).reshape(-1).view(torch.uint8), scale.reshape(1).view(torch.uint8)])


def unpacked(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``packed`` sent: the cast divided by its scale, in ``dtype``."""
    return (buf[:-4].view(E4M3).reshape(shape).float() / buf[-4:].clone().view(torch.float32)).to(dtype)


class Messages:
    """One step's messages on one rank; ``spec``: every message's ``shape``, ``dtype``, ``device``;
    ``fp8``: activations sent as their e4m3 casts (module doc)."""

    def __init__(self, step: Any, spec: dict, fp8: bool = False):
        self.step, self.spec, self.fp8 = step, spec, fp8
        # each family's message as it travels: activations (packed, under fp8), then gradients
        self.wire = [dict(spec, shape=(math.prod(spec["shape"]) + 4,), dtype=torch.uint8) if fp8 else spec, spec]
        self.sends: list = []
        self.posted: collections.deque = collections.deque()    # (RECV action, buffer, done), in order
        self.unposted: collections.deque = collections.deque()  # RECV actions not posted yet

    def start(self, actions: Iterable) -> None:
        """Before the first of ``actions``: their receives, the first one posted."""
        self.unposted = collections.deque(a for a in actions if a.kind in RECVS)
        self._post_next()

    def tag(self, family: int, stage: int, mb: int) -> int:
        sched = self.step.schedule
        return 1 + (family * sched.n_stages + stage) * sched.n_microbatches + mb

    def send(self, t: torch.Tensor, family: int, s: int, mb: int, peer: int) -> None:
        t = packed(t) if self.fp8 and family == 0 else t
        self.sends.append(lax.send(t, self.step.axis, dst=peer, tag=self.tag(family, s, mb)))

    def received(self, kind: str, s: int, mb: int) -> torch.Tensor:
        """The message of this RECV action, once arrived (the next receive posted first)."""
        a, out, done = self.posted.popleft()
        assert (a.kind, a.stage, a.microbatch) == (kind, s, mb), "receives are posted in action order"
        self._post_next()
        done()
        return unpacked(out, self.spec["shape"], self.spec["dtype"]) if self.fp8 and kind == "RECV_F" else out

    def _post_next(self) -> None:
        if self.unposted:
            a = self.unposted.popleft()
            family = RECVS.index(a.kind)
            tag = self.tag(family, a.stage, a.microbatch)
            self.posted.append((a, *lax.recv_start(self.step.axis, src=a.peer, tag=tag, **self.wire[family])))

    def reap(self) -> None:
        """Forget the sends that completed (never blocks)."""
        self.sends = [s for s in self.sends if not s.done()]

    def finish(self) -> None:
        """After the last action: every send waited for; every receive was read."""
        for s in self.sends:
            s.wait()
        self.sends = []
        assert not self.posted, "a validated schedule reads every message it receives"
