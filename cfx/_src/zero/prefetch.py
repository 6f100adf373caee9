"""ZeRO-3 prefetch inside one differentiated step: gathers in flight while other layers compute.

Within ``step_scope`` (``ztx.value_and_grad`` enters it: one forward, then one backward in the
reverse order) every gathered group of plain pieces is recorded in forward order, and

* forward: a gathered parent knows the groups its gathered children will ask for, in order
  (``expect``), so the first one's all-gather starts once the parent's own finished, and each
  child, once its own gather finished, starts the next one's (``take`` / ``then``), as FSDP's
  forward prefetch does: layer i+1's gather overlaps layer i's compute;
* backward: a group's re-gather starts the re-gather of the group gathered before it in forward
  (``ShardSource.before``, see ``gathered.py``): FSDP's backward prefetch.

A started gather is keyed by its pieces (the tensors themselves), so a child that asks for
something else simply gathers on its own; whatever was started and never used is finished and
dropped when the scope ends. Every rank runs the same code on the same structure, so the
collectives are issued in the same order everywhere.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from cfx._src.core import context
from cfx._src.lax import comm, groups
from cfx._src.zero.flat import concat_flat

WHERE = "cfx.zero.gathered"


def start(shard: torch.Tensor, axis: str) -> tuple:
    """The all-gather of ``shard`` over ``axis``, issued: ``(rows, done, order)``, see
    ``comm.all_gather_rows_start``."""
    ax = groups.axes((axis,), WHERE)
    rows, done = comm.all_gather_rows_start(shard, ax)
    return rows, done, ax.order


def _key(pieces: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(id(p) for p in pieces)  # the pieces live through the step: their ids are theirs


class StepGathers:
    """The gathers of one differentiated step on this rank."""

    def __init__(self):
        self.order: list[Any] = []                  # ShardSources gathered in forward, in order
        self.ahead: dict[tuple, tuple] = {}          # key -> started gather
        self.next_of: dict[tuple, tuple] = {}        # key -> (pieces, axis) forward gathers next

    def expect(self, groups: list[tuple[list[torch.Tensor], str]]) -> None:
        """Forward gathers ``groups`` (pieces, axis) next, in this order: the first starts now."""
        for (pieces, _), nxt in zip(groups, groups[1:]):
            self.next_of[_key(pieces)] = nxt
        if groups:
            self._start(*groups[0])

    def take(self, pieces: Sequence[torch.Tensor]) -> tuple | None:
        """The gather of ``pieces`` started ahead, or None."""
        return self.ahead.pop(_key(pieces), None)

    def then(self, pieces: Sequence[torch.Tensor]) -> None:
        """``pieces`` were just gathered: start the group forward needs after them, if known."""
        nxt = self.next_of.pop(_key(pieces), None)
        if nxt is not None:
            self._start(*nxt)

    def _start(self, pieces: list[torch.Tensor], axis: str) -> None:
        k = _key(pieces)
        if k not in self.ahead:
            self.ahead[k] = start(concat_flat([p.detach() for p in pieces]), axis)

    def close(self) -> None:
        for _, done, _ in self.ahead.values():  # started, never asked for: finish and drop
            done()
        self.ahead.clear()
        self.next_of.clear()
        self.order.clear()


_step: context.Var[StepGathers | None] = context.Var("cfx_zero_step_gathers", None)


def current() -> StepGathers | None:
    """The step's gathers inside ``step_scope``, else None."""
    return _step.get()


@contextlib.contextmanager
def step_scope():
    """One forward and one backward of gathered layers, in that order (see the module doc)."""
    step = StepGathers()
    token = _step.set(step)
    try:
        yield
    finally:
        _step.reset(token)
        step.close()
