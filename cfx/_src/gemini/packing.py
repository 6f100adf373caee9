"""Packing parameters into chunks: the packing rule, the chunk-size search and the layout.

Packing rule (used by the size search and the layout alike): tensors are taken in execution
order and placed contiguously in the current chunk; a tensor that does not fit in what is left
starts a new chunk; a tensor is never split. So the chunk size must be at least the largest
tensor, and the *waste* is the padding: ``n_chunks * size - total elements``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Mapping, Sequence


def _pack(numels: Sequence[int], size: int) -> Iterator[tuple[int, int]]:
    """``(chunk index, offset)`` for each tensor under the packing rule (all numels <= size)."""
    chunk, used = 0, 0
    for n in numels:
        if used + n > size:
            chunk, used = chunk + 1, 0
        yield chunk, used
        used += n


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclasses.dataclass(frozen=True)
class ChunkSearch:
    size: int              # chosen chunk size, elements
    n_chunks: int
    waste: int             # padding elements over all chunks
    waste_fraction: float  # waste / (n_chunks * size)
    step: int              # spacing of the candidate sizes that were tried
    n_candidates: int


def search_chunk_size(numels: Sequence[int], *, n_shards: int = 1, min_size: int = 1,
                      max_size: int | None = None, align: int = 1, step: int | None = None,
                      max_candidates: int = 4096, exact: bool = False) -> ChunkSearch:
    """The chunk size with the least padding for tensors of ``numels`` packed in this order.

    Candidates are multiples of ``n_shards * align`` (so every chunk splits into equal aligned
    shards), from the largest tensor (rounded up; at least ``min_size``) to ``max_size`` (default:
    the total rounded up; larger sizes only waste more), spaced ``step`` apart. Without ``step``
    the spacing is the smallest multiple of the unit giving at most ``max_candidates`` sizes.
    Ties go to the smaller size (finer-grained placement).

    ``exact=True`` (for a few tensors, e.g. one per layer) tries instead only the sizes where the
    waste can be least: ``lo`` and each run of consecutive tensors' total, rounded up to the unit.
    That is the minimum over *every* multiple of the unit in range: if no chunk is filled to
    within one unit of a size, the next smaller multiple packs the same way with less padding.
    """
    numels = [int(n) for n in numels]
    if not numels or any(n < 0 for n in numels):
        raise ValueError(f"search_chunk_size needs a non-empty list of tensor sizes >= 0, got {numels[:8]}.")
    if n_shards < 1 or align < 1:
        raise ValueError(f"n_shards and align must be >= 1, got n_shards={n_shards}, align={align}.")
    unit, total = n_shards * align, sum(numels)
    lo = _round_up(max(max(numels), min_size, 1), unit)
    hi = max(lo, _round_up(total, unit))
    if max_size is not None:
        if max_size < lo:
            raise ValueError(f"search_chunk_size: max_size={max_size} is below {lo}, the largest tensor "
                             f"({max(numels)} elements) rounded up to a multiple of n_shards*align={unit}; "
                             f"a tensor is never split across chunks, so raise max_size to >= {lo}.")
        hi = min(hi, max_size // unit * unit)
    if step is None:
        step = unit * max(1, math.ceil(((hi - lo) // unit + 1) / max_candidates))
    elif step <= 0 or step % unit:
        raise ValueError(f"step={step} must be a positive multiple of n_shards*align={unit}.")
    best = None
    candidates = range(lo, hi + 1, step)
    if exact:
        step, runs = unit, {lo}
        for i in range(len(numels)):
            acc = 0
            for n in numels[i:]:
                acc += n
                if _round_up(acc, unit) > hi:
                    break
                runs.add(max(lo, _round_up(acc, unit)))
        candidates = sorted(runs)
    for size in candidates:
        n_chunks = 1 + max((c for c, _ in _pack(numels, size)), default=0)
        waste = n_chunks * size - total
        if best is None or waste < best[0]:
            best = (waste, size, n_chunks)
    waste, size, n_chunks = best
    return ChunkSearch(size, n_chunks, waste, waste / (n_chunks * size), step, len(candidates))


@dataclasses.dataclass(frozen=True)
class SlotPlace:
    chunk: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where each tensor goes: ``places[path] = SlotPlace(chunk, offset, numel)``, in order."""

    chunk_size: int
    places: Mapping[str, SlotPlace]
    used: tuple[int, ...]   # elements in use per chunk

    @property
    def n_chunks(self) -> int:
        return len(self.used)

    @property
    def waste(self) -> int:
        return self.n_chunks * self.chunk_size - sum(self.used)

    def paths(self, chunk: int) -> list[str]:
        return [p for p, s in self.places.items() if s.chunk == chunk]

    @classmethod
    def build(cls, named_numels: Mapping[str, int] | Sequence[tuple[str, int]],
              chunk_size: int) -> "ChunkLayout":
        """Pack ``(path, numel)`` pairs, given in execution order, into chunks of ``chunk_size``."""
        items = list(named_numels.items() if isinstance(named_numels, Mapping) else named_numels)
        if len({p for p, _ in items}) != len(items):
            raise ValueError("ChunkLayout.build: tensor paths repeat; give each tensor once.")
        for path, n in items:
            if n > chunk_size:
                raise ValueError(f"ChunkLayout.build: {path!r} has {n} elements, more than chunk_size="
                                 f"{chunk_size}; tensors are never split, so use chunk_size >= {n} "
                                 "(search_chunk_size picks one).")
        places, used = {}, []
        for (path, n), (c, off) in zip(items, _pack([n for _, n in items], chunk_size)):
            places[path] = SlotPlace(c, off, n)
            used[c:] = [off + n]
        return cls(chunk_size, places, tuple(used))
