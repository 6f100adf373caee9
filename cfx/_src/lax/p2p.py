"""Point-to-point messages on a rank's group: ``send`` and ``recv``, with accounting.

Unlike the collectives (``comm``), only the two ranks of a message take part. A send never waits
for its receiver (it returns a handle to wait on later), so schedules whose ranks send before
they receive (1F1B's steady state) cannot deadlock; a recv blocks until its message arrived.
Messages between one pair are matched by ``tag``, so give each in-flight message its own tag.
Positions are requested positions along the ``Axes`` (``groups``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from cfx._src.lax.groups import Axes, backend_buffers, copy_back
from cfx._src.mesh.ledger import Call


class Pending:
    """An issued ``send``: ``wait()`` blocks until the payload has left; holds it until then."""

    __slots__ = ("_work", "_payload", "_wait")

    def __init__(self, work, payload: torch.Tensor, wait: Callable):
        self._work, self._payload, self._wait = work, payload, wait

    def wait(self) -> None:
        if self._work is not None:
            self._wait(self._work)
        self._work = self._payload = self._wait = None

    def done(self) -> bool:
        """True once the send completed (never blocks); the payload is released then."""
        if self._work is not None and self._work.is_completed():
            self.wait()
        return self._work is None


def _eager_only(where: str) -> None:
    if torch.compiler.is_dynamo_compiling():
        raise ValueError(f"{where}: point-to-point messages cannot be compiled (their handles live across "
                         "the graph); run this code (cfx.pipeline's executor) outside cfx.jit.")


def send(x: torch.Tensor, ax: Axes, dst: int, tag: int = 0) -> Pending:
    """Start sending ``x`` to requested position ``dst``; the caller must ``wait()`` the handle."""
    _eager_only("cfx.lax.send")
    assert dst != ax.index and ax.size > 1, "a rank never sends to itself"
    x = x.detach().contiguous()
    ax.record("send", x)
    group, to = ax.group, ax.group_rank(dst)
    call = Call("message", ax.names, (tuple(x.shape),), x.dtype, f"tag {tag}")
    key, seq = group.issue_message(call, group.rank, to, tag)
    buf, = backend_buffers(x)
    return Pending(group.get().send([buf], to, tag), buf, lambda work: group.wait(work, call, seq, key))


def recv(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, ax: Axes, src: int,
         tag: int = 0) -> torch.Tensor:
    """A fresh tensor of ``shape``/``dtype`` holding what requested position ``src`` sent with
    ``tag``; blocks until it arrived."""
    out, done = recv_start(shape, dtype, device, ax, src, tag)
    done()
    return out


def recv_start(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, ax: Axes,
               src: int, tag: int = 0) -> tuple[torch.Tensor, Callable[[], None]]:
    """``recv`` posted without waiting: ``(out, done)``, ``out`` holding the message once
    ``done()`` returned. A receive posted early lets the message move while this rank computes
    (gloo moves a message's bytes only once its receive is posted)."""
    _eager_only("cfx.lax.recv")
    assert src != ax.index and ax.size > 1, "a rank never receives from itself"
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    ax.record("recv", out)
    group, frm = ax.group, ax.group_rank(src)
    call = Call("message", ax.names, (tuple(out.shape),), out.dtype, f"tag {tag}")
    key, seq = group.issue_message(call, frm, group.rank, tag)
    buf, = backend_buffers(out)
    work = group.get().recv([buf], frm, tag)

    def done() -> None:
        group.wait(work, call, seq, key)
        copy_back([out], [buf])
    return out, done
