"""The KV cache's blocks: which are free, who holds each one, and which hold a known prefix.

The cache is one pool of ``num_blocks`` blocks of ``block_size`` token slots (per layer: ``paged``);
a sequence holds a list of them, its block table. ``BlockAllocator`` owns the bookkeeping:

- a **reference count** per block: the sequences whose tables hold it (several, where ``n > 1``
  samples share their prompt's blocks; a sequence about to write into a shared block copies it
  first: ``Engine``'s copy-on-write);
- a **prefix cache** (automatic prefix caching, as vLLM's): a block filled with tokens is registered
  under the hash of its tokens and of every token before it (``block_hash``), so a later sequence
  starting with the same tokens takes the block instead of computing it (``lookup``);
- three disjoint sets, which together are every block: **held** (count > 0), **cached** (count 0,
  registered: evictable, least recently released first) and **free** (count 0, not registered).

``allocate`` takes a free block, else evicts the least recently released cached one; ``release``
drops a reference and parks a block whose count reaches 0 in the cache (if registered) or the free
list. ``check()`` asserts the invariants (every block in exactly one set; counts equal the tables
that hold the block) -- what the stateful tests drive.
"""
from __future__ import annotations

import collections
import hashlib
import struct
from typing import Iterable, Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens after the block whose key is ``parent``
    (None: the first block). Equal keys mean equal tokens from position 0 to the block's end."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler preempts a sequence and retries)."""


class BlockAllocator:
    """Reference-counted blocks with a prefix cache (module doc)."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"cfx.serve: num_blocks and block_size must be positive, got {num_blocks}, {block_size}.")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # count 0, LRU first
        self.hash_of: dict[int, bytes] = {}   # registered blocks' keys
        self.by_hash: dict[bytes, int] = {}
        self.hits = self.queries = 0          # prefix-cache blocks found / looked up

    # -- counts ------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks ``allocate`` can still hand out (free, or cached and unreferenced)."""
        return len(self.free) + len(self.cached)

    @property
    def held(self) -> int:
        return self.num_blocks - self.available

    # -- taking and giving back ----------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one holder (count 1): a free one, else the least recently released cached one
        (forgotten by the prefix cache); ``OutOfBlocks`` when neither is left."""
        if self.free:
            b = self.free.popleft()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are held")
        self.refs[b] = 1
        return b

    def share(self, b: int) -> None:
        """One more holder of the held block ``b`` (a forked sequence's table)."""
        assert self.refs[b] > 0, f"block {b} is not held"
        self.refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer of each of ``blocks``; those nobody holds go to the cache or the free list."""
        for b in blocks:
            assert self.refs[b] > 0, f"block {b} released more often than taken"
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.cached[b] = None  # most recently released last
                else:
                    self.free.append(b)

    # -- the prefix cache ----------------------------------------------------------------------------
    def register(self, b: int, key: bytes) -> None:
        """Block ``b`` (held, full) holds the tokens ``key`` names; a block already registered under
        ``key`` (the same prefix computed twice at once) keeps the entry."""
        if not self.prefix_caching or b in self.hash_of or key in self.by_hash:
            return
        self.hash_of[b], self.by_hash[key] = key, b

    def lookup(self, key: bytes) -> int | None:
        """The block holding the prefix ``key``, now with one more holder, or None (a miss)."""
        if not self.prefix_caching:
            return None
        self.queries += 1
        b = self.by_hash.get(key)
        if b is None:
            return None
        self.hits += 1
        if self.refs[b] == 0:
            del self.cached[b]
        self.refs[b] += 1
        return b

    def check(self, tables: Iterable[Sequence[int]] = ()) -> None:
        """Assert the invariants (module doc); ``tables``: every live block table, whose holdings must
        be the reference counts."""
        counts = collections.Counter(b for t in tables for b in t)
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a block is free twice"
        held = {b for b in range(self.num_blocks) if self.refs[b] > 0}
        assert not (free & cached) and not (held & (free | cached)), "a block is in two sets"
        assert free | cached | held == set(range(self.num_blocks)), "a block is lost"
        assert all(b in self.hash_of for b in cached) and not (free & set(self.hash_of)), "cache state broken"
        assert all(self.by_hash[k] == b for b, k in self.hash_of.items()), "hash maps disagree"
        if tables or counts:
            assert all(self.refs[b] == counts.get(b, 0) for b in range(self.num_blocks)), "counts != tables"
