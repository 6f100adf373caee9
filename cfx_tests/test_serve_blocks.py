"""``cfx.serve.BlockAllocator`` under hypothesis' stateful testing: tables take, share, release and look
up blocks in any order, and after every rule no block is owned twice or lost, the reference counts are
the tables' holdings, and a block nobody holds is free or cached (never both)."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cfx.serve import BlockAllocator, OutOfBlocks, block_hash


class Tables(RuleBasedStateMachine):
    """Live block tables over one allocator; each table's blocks are its tokens' blocks in order."""

    @initialize(n=st.integers(1, 12), caching=st.booleans())
    def start(self, n, caching):
        self.blocks = BlockAllocator(n, 4, prefix_caching=caching)
        self.tables: list[list[int]] = []
        self.keys: list[list[bytes]] = []  # the prefix key of each registered block of each table

    @rule(prefix=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def new_table(self, prefix):
        """A sequence starts: it takes the cached blocks of its prefix, then one fresh block."""
        table, keys, parent = [], [], None
        for tok in prefix:
            key = block_hash(parent, [tok] * 4)
            b = self.blocks.lookup(key)
            if b is None:
                break
            table.append(b)
            keys.append(key)
            parent = key
        try:
            table.append(self.blocks.allocate())
        except OutOfBlocks:
            assert self.blocks.available == 0
            self.blocks.release(table)
            return
        self.tables.append(table)
        self.keys.append(keys)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def grow(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        if self.blocks.available:
            self.tables[i].append(self.blocks.allocate())
        else:
            with pytest.raises(OutOfBlocks):
                self.blocks.allocate()

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), tok=st.integers(0, 2))
    def fill(self, data, tok):
        """The table's next unregistered block is full of ``tok``: registered under its prefix key."""
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table, keys = self.tables[i], self.keys[i]
        if len(keys) < len(table):
            key = block_hash(keys[-1] if keys else None, [tok] * 4)
            self.blocks.register(table[len(keys)], key)
            keys.append(key)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        """``n > 1``: a second table holding the same blocks."""
        i = data.draw(st.integers(0, len(self.tables) - 1))
        for b in self.tables[i]:
            self.blocks.share(b)
        self.tables.append(list(self.tables[i]))
        self.keys.append(list(self.keys[i]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.blocks.release(self.tables.pop(i))
        self.keys.pop(i)

    @invariant()
    def holds(self):
        if hasattr(self, "blocks"):
            self.blocks.check(self.tables)
            if not self.tables:  # every block free or cached, none referenced
                assert self.blocks.available == self.blocks.num_blocks


TestTables = Tables.TestCase
TestTables.settings = settings(settings.default, stateful_step_count=40)  # examples: the profile's


def test_a_released_registered_block_is_found_again_until_evicted_least_recent_first():
    blocks = BlockAllocator(2, 4)
    a, b = blocks.allocate(), blocks.allocate()
    ka, kb = block_hash(None, [1] * 4), block_hash(None, [2] * 4)
    blocks.register(a, ka)
    blocks.register(b, kb)
    blocks.release([a])
    blocks.release([b])  # a released first: evicted first
    assert blocks.lookup(ka) == a and blocks.refs[a] == 1
    blocks.release([a])  # now b is the least recently released
    assert blocks.allocate() == b and blocks.lookup(kb) is None
    assert blocks.lookup(ka) == a
    blocks.check([[a], [b]])
    assert (blocks.hits, blocks.queries) == (2, 3)


def test_keys_name_the_whole_prefix_not_the_block_alone():
    one = block_hash(block_hash(None, [1, 2]), [3, 4])
    assert one == block_hash(block_hash(None, [1, 2]), [3, 4])
    assert one != block_hash(block_hash(None, [9, 2]), [3, 4]) and one != block_hash(None, [3, 4])
