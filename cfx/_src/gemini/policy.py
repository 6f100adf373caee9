"""Placement policies: which chunks sit on the device at each chunk access of a training step.

A step touches chunks in a fixed order, recorded once during a warm-up step as a
``WarmupRecord``: for each *access* (one layer's forward or backward, say), the chunks it needs
and the non-model bytes (activations, workspace) live on the device at that point. A policy
answers ``decide(record, position, resident) -> Step(evict, fetch)``: before access ``position``,
with ``resident`` chunks on the device, move ``evict`` off it and ``fetch`` onto it.

- ``device()``: everything stays on the device (fetch each chunk once, never evict).
- ``host()``: chunks live on the host; each access fetches what it needs and the chunks it does
  not need go back.
- ``auto(budget, prefetch=k)``: keep chunk bytes + non-model bytes <= ``budget`` at every access,
  evicting the chunk whose next use is furthest in the future (Belady's rule: with equal-size
  chunks this moves the fewest chunks onto the device, for any capacity that varies over time),
  then pull each fetch up to ``k`` accesses earlier where the budget has room on every access in
  between, so copies overlap compute without moving any more chunks.

``plan_auto`` is the pure planner behind ``auto``; ``decide`` re-plans from the current state.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

from cfx._src.core.text import format_bytes


@dataclasses.dataclass(frozen=True)
class Step:
    evict: tuple[int, ...]   # chunk indices moved off the device before the access
    fetch: tuple[int, ...]   # chunk indices moved onto the device before the access


@dataclasses.dataclass(frozen=True)
class WarmupRecord:
    accesses: tuple[tuple[int, ...], ...]   # chunks needed by each access, in step order
    non_model_bytes: tuple[int, ...]        # device bytes that are not chunks, at each access
    chunk_bytes: tuple[int, ...]            # device bytes of each chunk

    def __post_init__(self):
        if len(self.accesses) != len(self.non_model_bytes):
            raise ValueError(f"WarmupRecord: {len(self.accesses)} accesses but "
                             f"{len(self.non_model_bytes)} non-model byte counts; give one per access.")
        bad = sorted({c for a in self.accesses for c in a if not 0 <= c < len(self.chunk_bytes)})
        if bad:
            raise ValueError(f"WarmupRecord: accesses name chunks {bad} but chunk_bytes covers "
                             f"only chunks 0..{len(self.chunk_bytes) - 1}.")


@dataclasses.dataclass(frozen=True)
class DevicePolicy:
    def decide(self, record: WarmupRecord, position: int, resident) -> Step:
        del position
        return Step((), tuple(sorted(set(range(len(record.chunk_bytes))) - set(resident))))


@dataclasses.dataclass(frozen=True)
class HostPolicy:
    def decide(self, record: WarmupRecord, position: int, resident) -> Step:
        need, resident = set(record.accesses[position]), set(resident)
        return Step(tuple(sorted(resident - need)), tuple(sorted(need - resident)))


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
    device_budget_bytes: int
    prefetch: int = 1

    def __post_init__(self):
        if self.device_budget_bytes <= 0 or self.prefetch < 0:
            raise ValueError(f"auto(device_budget_bytes={self.device_budget_bytes}, "
                             f"prefetch={self.prefetch}): the budget must be > 0 bytes and "
                             "prefetch >= 0 accesses.")

    def plan(self, record: WarmupRecord, resident=()) -> list[Step]:
        return plan_auto(record.accesses, record.chunk_bytes, record.non_model_bytes,
                         self.device_budget_bytes, prefetch=self.prefetch, resident=resident)

    def plan_from(self, record: WarmupRecord, position: int, resident, *,
                  reserve: int = 0) -> list[tuple[frozenset, Step]]:
        """From access ``position`` on, with ``resident`` chunks on the device: per access, the
        chunks on the device before it if the plan is followed, and its step; ``reserve`` bytes of
        the budget are left free (for memory the record does not show)."""
        out, live = [], frozenset(resident)
        for a, step in zip(record.accesses[position:], plan_auto(
                record.accesses[position:], record.chunk_bytes, record.non_model_bytes[position:],
                self.device_budget_bytes - reserve, prefetch=self.prefetch, resident=resident)):
            out.append((live, step))
            live = (live - set(step.evict)) | set(step.fetch) | set(a)
        return out

    def decide(self, record: WarmupRecord, position: int, resident) -> Step:
        return plan_auto(record.accesses[position:], record.chunk_bytes, record.non_model_bytes[position:],
                         self.device_budget_bytes, prefetch=self.prefetch, resident=resident)[0]


def device() -> DevicePolicy:
    return DevicePolicy()


def host() -> HostPolicy:
    return HostPolicy()


def auto(device_budget_bytes: int, *, prefetch: int = 1) -> AutoPolicy:
    return AutoPolicy(int(device_budget_bytes), prefetch)


def plan_auto(access_sequence: Sequence[Sequence[int]], chunk_bytes: int | Sequence[int],
              non_model_bytes: Sequence[int], budget: int, *, prefetch: int = 0,
              resident: Sequence[int] = ()) -> list[Step]:
    """Per access, the chunks to evict and fetch before it (see the module doc).

    ``chunk_bytes`` is one size for every chunk or a size per chunk index. Raises ``ValueError``
    stating the bytes needed when some access alone (its chunks + its non-model bytes) exceeds
    ``budget``.
    """
    size = (lambda c: chunk_bytes) if isinstance(chunk_bytes, int) else (lambda c: chunk_bytes[c])
    accesses = [frozenset(a) for a in access_sequence]
    if len(accesses) != len(non_model_bytes):
        raise ValueError(f"plan_auto: {len(accesses)} accesses but {len(non_model_bytes)} non-model byte "
                         "counts; give one per access.")
    needs = [sum(size(c) for c in a) + nm for a, nm in zip(accesses, non_model_bytes)]
    if needs and max(needs) > budget:
        t = max(range(len(needs)), key=needs.__getitem__)
        raise ValueError(f"auto placement needs at least {max(needs)} bytes of device memory: access {t} "
                         f"uses chunks {sorted(accesses[t])} ({needs[t] - non_model_bytes[t]} bytes) with "
                         f"{non_model_bytes[t]} non-model bytes live, but the budget is {budget} bytes "
                         f"({format_bytes(budget)}). Raise the device budget to at least {format_bytes(max(needs))} "
                         "(offload=auto:<bytes> in a Plan, cfx.gemini.auto(bytes) in code), use smaller chunks, "
                         "or place one chunk at a time (offload=host, cfx.gemini.host()).")
    uses: dict[int, list[int]] = {}
    for t, a in enumerate(accesses):
        for c in a:
            uses.setdefault(c, []).append(t)

    def next_use(c: int, t: int) -> float:
        u = uses.get(c, [])
        i = bisect.bisect_left(u, t)
        return u[i] if i < len(u) else float("inf")

    # 1. Belady on demand: fetch what the access needs; evict furthest-next-use until it fits.
    live, held, steps, sets = set(resident), sum(size(c) for c in set(resident)), [], []
    for t, need in enumerate(accesses):
        fetch = need - live
        held += sum(size(c) for c in fetch)
        victims = sorted(live - need, key=lambda c: (-next_use(c, t + 1), c))
        evict = []
        while held + non_model_bytes[t] > budget:
            c = victims.pop(0)
            evict.append(c)
            held -= size(c)
        live = (live - set(evict)) | fetch
        steps.append([tuple(evict), sorted(fetch)])
        sets.append(set(live))
    # 2. Prefetch: pull each fetch up to `prefetch` accesses earlier, after its last eviction,
    #    where every access in between has room for it. Same transfers, earlier.
    if prefetch:
        evicted_at: dict[int, int] = {}
        for t, (evict, fetch) in enumerate(steps):
            for c in list(fetch):
                s = t
                while (s - 1 >= max(t - prefetch, evicted_at.get(c, -1) + 1)
                       and sum(size(x) for x in sets[s - 1]) + size(c) + non_model_bytes[s - 1] <= budget):
                    s -= 1
                if s < t:
                    fetch.remove(c)
                    steps[s][1].append(c)
                    for u in range(s, t):
                        sets[u].add(c)
            for c in evict:
                evicted_at[c] = t
    return [Step(tuple(sorted(e)), tuple(sorted(f))) for e, f in steps]
