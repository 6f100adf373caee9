"""A chain of stages described only by its costs: the input of the checkpointing solver.

Stage ``i`` (1-based, ``1..n``) maps activation ``a[i-1]`` to ``a[i]``; ``a[0]`` is the chain
input. Every cost list is indexed so that ``fw[i]`` is stage ``i``'s cost (index 0 of the
per-stage lists is unused and must be 0), while ``x[i]`` is the size of activation ``a[i]`` for
``i = 0..n``. See ``solver.py`` for the memory model these numbers feed.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Chain:
    """Per-stage costs of a chain of ``n`` stages (all lists have length ``n + 1``).

    fw[i]:     forward time of stage i (fw[0] = 0).
    bw[i]:     backward time of stage i (bw[0] = 0).
    x[i]:      size of activation a[i], the output of stage i; x[0] is the chain input.
    xbar[i]:   size of everything stage i keeps for its backward when run with grad, *including*
               its output a[i] but *excluding* its input a[i-1] (which the backward reads from
               memory where it already lives), so xbar[i] >= x[i]; xbar[0] = 0.
    bw_tmp[i]: temporary memory the backward of stage i allocates on top of its inputs and its
               output gradient (default all 0).
    """

    fw: tuple
    bw: tuple
    x: tuple
    xbar: tuple
    bw_tmp: tuple = None

    def __post_init__(self):
        n = len(self.x) - 1
        if n < 1:
            raise ValueError(f"Chain: x must list the input size and at least one stage output "
                             f"(length n + 1 >= 2), got {list(self.x)!r}.")
        bw_tmp = self.bw_tmp if self.bw_tmp is not None else (0,) * (n + 1)
        for name, seq in (("fw", self.fw), ("bw", self.bw), ("x", self.x), ("xbar", self.xbar),
                          ("bw_tmp", bw_tmp)):
            object.__setattr__(self, name, tuple(seq))
            _check(name, getattr(self, name), n, integer=name in ("x", "xbar", "bw_tmp"))
        for name in ("fw", "bw", "xbar", "bw_tmp"):
            if getattr(self, name)[0] != 0:
                raise ValueError(f"Chain: {name}[0] must be 0 (stages are numbered from 1), "
                                 f"got {getattr(self, name)[0]!r}.")
        for i in range(1, n + 1):
            if self.xbar[i] < self.x[i]:
                raise ValueError(f"Chain: xbar[{i}] = {self.xbar[i]} < x[{i}] = {self.x[i]}; "
                                 "xbar counts everything stage i saves for backward, its output "
                                 "included, so it is at least x[i].")

    @property
    def n(self) -> int:
        """Number of stages."""
        return len(self.x) - 1

    @classmethod
    def from_stages(cls, fw: Sequence, bw: Sequence, x: Sequence, xbar: Sequence,
                    bw_tmp: Sequence | None = None) -> "Chain":
        """Build from per-stage lists of length n (``x`` has length n + 1: input first)."""
        pad = lambda s: (0, *s)  # noqa: E731
        return cls(fw=pad(fw), bw=pad(bw), x=tuple(x), xbar=pad(xbar),
                   bw_tmp=None if bw_tmp is None else pad(bw_tmp))


def _check(name: str, seq: tuple, n: int, *, integer: bool) -> None:
    if len(seq) != n + 1:
        raise ValueError(f"Chain: {name} has length {len(seq)}, expected n + 1 = {n + 1} "
                         f"(n = len(x) - 1 stages).")
    for i, v in enumerate(seq):
        kind = numbers.Integral if integer else numbers.Real
        if isinstance(v, bool) or not isinstance(v, kind) or v < 0:
            what = "a non-negative integer (bytes)" if integer else "a non-negative number"
            raise ValueError(f"Chain: {name}[{i}] = {v!r} must be {what}.")
