"""Gemini chunks: size search vs brute force, layouts, slot views, shard bookkeeping."""
import pytest
import torch
from hypothesis import given, strategies as st

import cfx.memory as cm
from cfx.gemini import (Chunk, ChunkLayout, IllegalTransition, TensorState as S, make_stores,
                        search_chunk_size)

numel_lists = st.lists(st.integers(0, 40), min_size=1, max_size=12)


def naive_waste(numels, size):
    """Chunks needed when packing in order without splitting, times size, minus the total."""
    chunks, room = 0, 0
    for n in numels:
        if n > room or chunks == 0:
            chunks, room = chunks + 1, size
        room -= n
    return chunks * size - sum(numels)


@given(numel_lists, st.integers(1, 3), st.integers(1, 4))
def test_search_minimises_waste_over_all_sizes(numels, n_shards, align):
    unit = n_shards * align
    found = search_chunk_size(numels, n_shards=n_shards, align=align)
    assert found.size % unit == 0 and found.size >= max(numels)
    assert found.waste == naive_waste(numels, found.size)
    assert found.waste_fraction == pytest.approx(found.waste / (found.n_chunks * found.size))
    # brute force well past the search range: nothing wastes less
    sizes = [s for s in range(unit, 3 * sum(numels) + 2 * unit, unit) if s >= max(numels)]
    best = min(naive_waste(numels, s) for s in sizes)
    assert found.waste == best
    assert found.size == min(s for s in sizes if naive_waste(numels, s) == best)  # ties: smaller


def test_search_respects_bounds_and_step():
    numels = [10, 10, 10, 7]
    assert search_chunk_size(numels).waste == 0  # 37 elements in one chunk of 37
    r = search_chunk_size(numels, max_size=24)
    assert (r.size, r.waste, r.n_chunks) == (10, 3, 4)  # ties 20 (waste 3): the smaller size wins
    r = search_chunk_size(numels, min_size=40, step=8)
    assert r.size == 40 and r.step == 8
    with pytest.raises(ValueError, match="raise max_size to >= 12"):
        search_chunk_size([5, 11], n_shards=4, max_size=8)
    with pytest.raises(ValueError, match="multiple of n_shards"):
        search_chunk_size(numels, n_shards=2, step=3)
    many = search_chunk_size([3] * 1000 + [50], max_candidates=100)  # sizes 50..3050
    assert many.n_candidates <= 100 and many.step == 31


@given(st.lists(st.integers(0, 30), min_size=1, max_size=15), st.integers(0, 20))
def test_layout_offsets_follow_order_and_never_overlap(numels, extra):
    size = max(numels) + extra
    names = [f"t{i}" for i in range(len(numels))]
    layout = ChunkLayout.build(list(zip(names, numels)), size)
    places = [layout.places[n] for n in names]
    assert [(p.numel) for p in places] == numels
    prev = None
    for p in places:
        assert 0 <= p.offset and p.offset + p.numel <= size
        if prev is not None:  # in order: same chunk right after the previous one, or a new chunk
            assert (p.chunk, p.offset) in {(prev.chunk, prev.offset + prev.numel), (prev.chunk + 1, 0)}
            if p.chunk == prev.chunk + 1:
                assert prev.offset + prev.numel + p.numel > size  # it did not fit
        prev = p
    assert layout.used == tuple(max(p.offset + p.numel for p in places if p.chunk == c)
                                for c in range(layout.n_chunks))
    assert layout.waste == naive_waste(numels, size)
    assert sum(len(layout.paths(c)) for c in range(layout.n_chunks)) == len(numels)


def test_layout_rejects_oversized_tensors():
    with pytest.raises(ValueError, match="'big' has 9 elements.*chunk_size >= 9"):
        ChunkLayout.build({"a": 2, "big": 9}, 8)


def tensors(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.randn(s, generator=g).to(dtype)) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_view_the_right_data_and_updates_persist(dtype):
    named = tensors([(3, 4), (5,), (), (2, 2, 2)], dtype, 0)
    chunk = Chunk.pack(named, size=32, stores=make_stores(), key="c0")
    assert chunk.states == {p: S.FREE for p, _ in named}
    with pytest.raises(ValueError, match="'p0' in chunk 'c0' is FREE"):
        chunk.view("p0")
    chunk.materialize()
    for p, t in named:
        assert torch.equal(chunk.view(p), t) and chunk.view(p).shape == t.shape
    chunk.view("p1").mul_(2)
    chunk.release()
    chunk.materialize()
    assert torch.equal(chunk.view("p1"), named[1][1] * 2)
    assert torch.equal(chunk.view("p0"), named[0][1])


@given(st.integers(1, 4), st.integers(0, 3))
def test_shards_gather_back_into_the_full_payload(n_shards, seed):
    named = tensors([(3,), (4, 2), (5,)], torch.float32, seed)
    size = 16 * n_shards
    chunks = [Chunk.pack(named, size=size, stores=make_stores(), key="c", n_shards=n_shards, shard_index=i)
              for i in range(n_shards)]
    for i, c in enumerate(chunks):
        assert c.shard_size == size // n_shards
        assert c.shard_range == (i * c.shard_size, (i + 1) * c.shard_size)
    gathered = torch.cat([c.shard for c in chunks])  # what an all-gather in rank order returns
    for i, c in enumerate(chunks):
        c.materialize(gathered.clone() if n_shards > 1 else None)
        for p, t in named:
            assert torch.equal(c.view(p), t)
        c.view("p1").fill_(i + 1.0)  # every rank writes its own value into the full payload
        c.release()
        lo, hi = c.shard_range
        expect = gathered[lo:hi].clone()
        off = c.slots["p1"].offset
        for j in range(lo, hi):
            if off <= j < off + 8:
                expect[j - lo] = i + 1.0
        assert torch.equal(c.shard, expect)  # only this rank's range was written back


def test_gathered_payload_is_accounted_on_device_until_release():
    named = tensors([(6,), (2,)], torch.float32, 1)
    with cm.track() as mem:
        c = Chunk.pack(named, size=8, stores=make_stores(), key="c", n_shards=2, shard_index=1)
        assert mem.live("device", kind="chunk") == 4 * 4
        c.materialize(torch.zeros(8))
        assert mem.live("device", kind="gathered") == 8 * 4
        c.release()
        assert mem.live("device", kind="gathered") == 0 and mem.peak("device") == 12 * 4


def test_chunk_state_changes_go_through_the_table():
    c = Chunk.pack(tensors([(2,), (3,)], torch.float32, 2), size=5, stores=make_stores(), key="c1")
    with pytest.raises(ValueError, match="use materialize"):
        c.set_state("p0", S.COMPUTE)
    c.materialize()
    c.set_states(S.COMPUTE)
    c.set_state("p0", S.HOLD_AFTER_FWD)
    with pytest.raises(IllegalTransition, match="'p1' in chunk 'c1'.*COMPUTE -> FREE"):
        c.release()  # p1 is still in use; nothing changed
    assert c.state("p0") == S.HOLD_AFTER_FWD and c.is_materialized
    c.set_state("p1", S.HOLD_AFTER_BWD)
    with pytest.raises(IllegalTransition, match="Reduce the gradient"):
        c.release()
    c.set_state("p1", S.HOLD)
    with pytest.raises(ValueError, match="release\\(\\) it before moving"):
        c.move_to("host")
    c.release()
    assert c.states == {"p0": S.FREE, "p1": S.FREE} and not c.is_materialized
    with pytest.raises(IllegalTransition, match="FREE -> FREE"):
        c.release()
    c.move_to("host")
    with pytest.raises(ValueError, match="move_to\\('device'\\) before gathering"):
        c.materialize()
    with pytest.raises(ValueError, match="divisible by n_shards=3"):
        Chunk.pack(tensors([(2,)], torch.float32, 0), size=8, stores=make_stores(), key="x", n_shards=3)
