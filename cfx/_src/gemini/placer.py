"""Following a placement policy through a training step: which chunks are on the device at each
chunk access, the moves before it, and ``auto``'s warm-up measurement.

One ``Placer`` per rank serves every step of whoever owns the chunks (``GeminiEngine``'s
stores, a Plan's offloaded ZeRO-3 pieces); the owner says how to move a chunk::

    placer = Placer(cfx.gemini.auto(budget), chunk_bytes, fetch=load, evict=drop)
    with placer.step(agree=lambda v: cfx.lax.pmax(v, "data")):
        ...                      # each gathered layer calls placer.access(its chunk) first

``access(c)`` applies the policy before access ``position`` (which needs chunk ``c``):
``device`` fetches and never evicts, ``host`` keeps only ``c``, ``auto`` follows its Belady plan
(prefetches at their planned accesses, 0.1% of the budget held back), re-planned from the
current access when the device holds other chunks than the plan expected. The first step under
``auto`` is the warm-up: it moves chunks like ``host`` while ``cfx.memory`` measures the
non-model device bytes of every access (``warmup``); ``agree`` makes that record the same on
every rank that shares it (the max: frees are timed by the garbage collector), and the plan is
checked against the budget at once (``ValueError`` if it cannot fit).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from cfx._src.gemini.policy import AutoPolicy, DevicePolicy, WarmupRecord
from cfx._src.gemini.warmup import Recorder
from cfx._src.transforms.shapes import is_abstract


class Placer:
    """See the module doc. ``resident`` (the chunks on the device) persists across steps."""

    def __init__(self, policy, chunk_bytes: Sequence[int], *, fetch: Callable[[int], None],
                 evict: Callable[[int], None]):
        self.policy, self.chunk_bytes = policy, list(chunk_bytes)
        self._fetch, self._evict = fetch, evict  # move chunk c onto / off the device
        self.record: WarmupRecord | None = None
        self.resident: set[int] = set()
        self.position = 0
        self._plan = None  # auto: per access, (the chunks on the device before it, its step)
        self._recorder = None

    @property
    def warming_up(self) -> bool:
        return isinstance(self.policy, AutoPolicy) and self.record is None

    @property
    def reserve(self) -> int:
        """0.1% of the budget, left out of the plan: for what the warm-up cannot see (losses kept)."""
        return self.policy.device_budget_bytes // 1000

    @contextlib.contextmanager
    def step(self, *, agree: Callable[[torch.Tensor], torch.Tensor]):
        """One step's accesses; ``agree`` reduces the warm-up's per-access non-model bytes (an int64
        tensor) over the ranks that share the record."""
        self.position = 0
        warm = self.warming_up
        self._recorder = Recorder() if warm else None
        try:
            with (self._recorder.tracking() if warm else contextlib.nullcontext()):
                yield self
                if warm:
                    self._recorder.end_access()
            if warm:
                rec = self._recorder.record(self.chunk_bytes)
                worst = agree(torch.tensor(rec.non_model_bytes, dtype=torch.int64))
                if is_abstract(worst):  # a shape-only run (Plan.describe) measures nothing
                    return
                self.record = WarmupRecord(rec.accesses, tuple(int(v) for v in worst.tolist()), rec.chunk_bytes)
                self.policy.plan_from(self.record, 0, (), reserve=self.reserve)  # ValueError if too small
        finally:
            self._recorder = None

    def access(self, c: int) -> None:
        """The policy's moves before the next access, which needs chunk ``c``."""
        rec = self._recorder
        if rec is not None:
            rec.end_access()
        t, policy, record = self.position, self.policy, self.record
        if isinstance(policy, DevicePolicy):
            evict, fetch = (), (c,)
        elif isinstance(policy, AutoPolicy) and record is not None and t < len(record.accesses) \
                and record.accesses[t] == (c,):
            step = self._auto_step(t)
            evict, fetch = step.evict, step.fetch
        else:  # host, the warm-up step, or an access pattern the warm-up did not see
            evict, fetch = tuple(self.resident - {c}), (c,)
        for e in evict:
            self.evict(e)
        for f in (*fetch, c):
            self.fetch(f)
        if rec is not None:
            rec.begin_access(c, sum(self.chunk_bytes[r] for r in self.resident))
        self.position += 1

    def fetch(self, c: int) -> None:
        if c not in self.resident:
            self._fetch(c)
            self.resident.add(c)

    def evict(self, c: int) -> None:
        if c in self.resident:
            self._evict(c)
            self.resident.discard(c)

    def evict_all(self) -> None:
        for c in sorted(self.resident):
            self.evict(c)

    def _auto_step(self, t: int):
        """Access ``t``'s planned step, re-planned from ``t`` when the resident chunks are not the
        plan's (the first step after the warm-up, a micro-batch, ...)."""
        planned = self._plan[t] if self._plan else None
        if planned is None or planned[0] != frozenset(self.resident):
            self._plan = [None] * t + self.policy.plan_from(self.record, t, sorted(self.resident),
                                                            reserve=self.reserve)
        return self._plan[t][1]
