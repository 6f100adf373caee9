"""Chunks: parameters packed in execution order into equal-size flat buffers (see ``packing``).

A ``Chunk`` of ``size`` elements is sharded over ``n_shards`` ranks: this rank persistently owns
elements ``[shard_index * shard_size, (shard_index + 1) * shard_size)`` (its *shard*), stored in
one tier store under the chunk's key. To compute, the caller gathers the full payload (an
all-gather of every rank's shard; with one shard the shard itself) and hands it to
``materialize``; slots are then views into it. ``release`` writes this rank's part back into the
shard and drops the full payload. Every slot's state moves through ``states.transition``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import torch

from cfx._src.mesh import memory
from cfx._src.gemini.packing import ChunkLayout, ChunkSearch, SlotPlace, search_chunk_size
from cfx._src.gemini.states import TensorState, transition

__all__ = ["Chunk", "ChunkLayout", "ChunkSearch", "Slot", "SlotPlace", "search_chunk_size"]


@dataclasses.dataclass(frozen=True)
class Slot:
    path: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Chunk:
    """One chunk as seen by one rank: its slots, their states, its shard and tier (see module doc)."""

    def __init__(self, slots: Sequence[Slot], *, size: int, dtype: torch.dtype, stores: Mapping,
                 key: str, tier: str = "device", n_shards: int = 1, shard_index: int = 0,
                 shard: torch.Tensor | None = None):
        if size % n_shards:
            raise ValueError(f"chunk {key!r}: size {size} is not divisible by n_shards={n_shards}; "
                             "pick the size with search_chunk_size(..., n_shards=n_shards).")
        if not 0 <= shard_index < n_shards:
            raise ValueError(f"chunk {key!r}: shard_index {shard_index} is outside [0, {n_shards}).")
        if tier not in stores:
            raise ValueError(f"chunk {key!r}: no store for tier {tier!r}; stores has {sorted(stores)}.")
        if any(key in s for s in stores.values()):
            raise ValueError(f"chunk key {key!r} is already in use in these stores; "
                             "give each chunk its own key.")
        end = 0
        for s in sorted(slots, key=lambda s: s.offset):
            if s.offset < end or s.offset + s.numel > size:
                raise ValueError(f"chunk {key!r}: slot {s.path!r} at [{s.offset}, {s.offset + s.numel}) "
                                 f"overlaps another slot or runs past the chunk size {size}.")
            end = s.offset + s.numel
        self.slots = {s.path: s for s in slots}
        self.size, self.dtype, self.key, self.tier = size, dtype, key, tier
        self.n_shards, self.shard_index, self.stores = n_shards, shard_index, stores
        self._states = {p: TensorState.FREE for p in self.slots}
        self._full: torch.Tensor | None = None
        self._full_token = None
        if shard is None:
            shard = torch.zeros(self.shard_size, dtype=dtype)
        if shard.shape != (self.shard_size,) or shard.dtype != dtype:
            raise ValueError(f"chunk {key!r}: shard must be 1-D of {self.shard_size} {dtype}, "
                             f"got {tuple(shard.shape)} {shard.dtype}.")
        stores[tier].put(key, shard)

    @classmethod
    def pack(cls, named_tensors: Sequence[tuple[str, torch.Tensor]], *, size: int, stores: Mapping, key: str,
             tier: str = "device", n_shards: int = 1, shard_index: int = 0,
             dtype: torch.dtype | None = None) -> "Chunk":
        """A chunk holding ``named_tensors`` back to back; this rank keeps its shard (state FREE)."""
        dtype = dtype or named_tensors[0][1].dtype
        full = torch.zeros(size, dtype=dtype)
        slots, off = [], 0
        for path, t in named_tensors:
            if off + t.numel() > size:
                raise ValueError(f"chunk {key!r}: {path!r} does not fit ({off} + {t.numel()} > size {size}).")
            full[off:off + t.numel()] = t.detach().reshape(-1).to(dtype)
            slots.append(Slot(path, tuple(t.shape), off))
            off += t.numel()
        lo, n = shard_index * (size // n_shards), size // n_shards  # the constructor checks both
        return cls(slots, size=size, dtype=dtype, stores=stores, key=key, tier=tier, n_shards=n_shards,
                   shard_index=shard_index, shard=full[lo:lo + n].clone())

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def shard_size(self) -> int:
        return self.size // self.n_shards

    @property
    def shard_range(self) -> tuple[int, int]:
        lo = self.shard_index * self.shard_size
        return lo, lo + self.shard_size

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_materialized(self) -> bool:
        return self._full is not None

    @property
    def states(self) -> dict[str, TensorState]:
        return dict(self._states)

    def state(self, path: str) -> TensorState:
        return self._states[self._slot(path).path]

    def _slot(self, path: str) -> Slot:
        if path not in self.slots:
            raise ValueError(f"chunk {self.key!r} has no tensor {path!r}; it holds {list(self.slots)}.")
        return self.slots[path]

    def set_state(self, path: str, new: TensorState) -> None:
        self.set_states(new, paths=[path])

    def set_states(self, new: TensorState, *, paths: Sequence[str] | None = None) -> None:
        """Move ``paths`` (default: every slot) to ``new``; all or nothing if one move is illegal."""
        paths = list(self.slots) if paths is None else [self._slot(p).path for p in paths]
        if self._full is None or new is TensorState.FREE:
            # A chunk's slots are gathered and released together, with the payload.
            raise ValueError(f"chunk {self.key!r}: slots enter and leave FREE only with the payload; "
                             "use materialize() to gather and release() to free the chunk.")
        moved = {p: transition(self._states[p], new, what=f"{p!r} in chunk {self.key!r}") for p in paths}
        self._states.update(moved)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's persistent shard (the stored tensor itself on device / host tiers)."""
        if self.tier == "nvme":
            raise ValueError(f"chunk {self.key!r} is on nvme; move_to('host' or 'device') before reading it.")
        return self.stores[self.tier].get(self.key)

    # -- payload -------------------------------------------------------------------------------
    def materialize(self, gathered: torch.Tensor | None = None) -> None:
        """Take the full payload (all shards in rank order; omit it with one shard): FREE -> HOLD."""
        if self.tier != "device":
            raise ValueError(f"chunk {self.key!r} is on {self.tier}; move_to('device') before gathering it.")
        shard = self.shard
        if gathered is None:
            if self.n_shards != 1:
                raise ValueError(f"chunk {self.key!r} is split over {self.n_shards} shards; pass the "
                                 "all-gathered payload to materialize().")
            gathered = shard
        elif (gathered.shape, gathered.dtype, gathered.device) != ((self.size,), self.dtype, shard.device):
            raise ValueError(f"chunk {self.key!r}: the gathered payload must be 1-D of {self.size} "
                             f"{self.dtype} on {shard.device}, got {tuple(gathered.shape)} {gathered.dtype} "
                             f"on {gathered.device}.")
        moved = {p: transition(s, TensorState.HOLD, what=f"{p!r} in chunk {self.key!r}")
                 for p, s in self._states.items()}
        self._full = gathered
        if gathered is not shard:
            self._full_token = memory.record_alloc(self.nbytes, tier="device", kind="gathered", key=self.key)
        self._states.update(moved)

    def view(self, path: str) -> torch.Tensor:
        """The slot as a tensor of its shape, a view into the full payload."""
        s = self._slot(path)
        if self._full is None:
            raise ValueError(f"{path!r} in chunk {self.key!r} is FREE (not materialised); "
                             "materialize() the chunk before viewing its tensors.")
        return self._full[s.offset:s.offset + s.numel].view(s.shape)

    def release(self) -> None:
        """Write this rank's part of the payload back into its shard and drop the payload: -> FREE."""
        moved = {p: transition(s, TensorState.FREE, what=f"{p!r} in chunk {self.key!r}")
                 for p, s in self._states.items()}
        assert self._full is not None or not moved, "slots left FREE must have no payload"
        shard = self.shard
        if self._full is not None and self._full is not shard:
            lo, hi = self.shard_range
            shard.copy_(self._full[lo:hi])
        self._full = None
        memory.record_free(self._full_token)
        self._full_token = None
        self._states.update(moved)

    def move_to(self, tier: str) -> None:
        """Move the shard to ``tier``'s store, bit for bit. The chunk must be released first."""
        if tier not in self.stores:
            raise ValueError(f"chunk {self.key!r}: no store for tier {tier!r}; "
                             f"stores has {sorted(self.stores)}.")
        if self._full is not None:
            raise ValueError(f"chunk {self.key!r} is materialised; release() it before moving it to {tier}.")
        if tier == self.tier:
            return
        src = self.stores[self.tier]
        self.stores[tier].put(self.key, src.get(self.key))
        src.delete(self.key)
        self.tier = tier
