"""The Placer follows a policy through a step's chunk accesses: ``host`` keeps only the chunk in
use, ``device`` keeps every chunk, ``auto`` makes exactly ``plan_auto``'s moves (and re-plans when
the device holds other chunks than planned); a file-backed tensor keeps its values in its file."""
from __future__ import annotations

import os

import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.gemini.mapped import mapped_copy
from cfx._src.gemini.placer import Placer
from cfx._src.gemini.policy import WarmupRecord, plan_auto


def placer(policy, chunk_bytes, record=None):
    moves = []
    p = Placer(policy, chunk_bytes, fetch=lambda c: moves.append(("fetch", c)),
               evict=lambda c: moves.append(("evict", c)))
    p.record = record
    return p, moves


def run(p, accesses):
    with p.step(agree=lambda v: v):
        for c in accesses:
            p.access(c)
            assert c in p.resident


def test_host_keeps_only_the_chunk_in_use_and_device_keeps_all():
    p, moves = placer(cfx.gemini.host(), [10, 10, 10])
    run(p, [0, 1, 1, 2, 0])
    assert moves == [("fetch", 0), ("evict", 0), ("fetch", 1), ("evict", 1), ("fetch", 2), ("evict", 2), ("fetch", 0)]
    p, moves = placer(cfx.gemini.device(), [10, 10, 10])
    run(p, [0, 1, 2, 1, 0])
    assert moves == [("fetch", 0), ("fetch", 1), ("fetch", 2)]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=20), st.integers(2, 5), st.integers(0, 2))
def test_auto_makes_the_planned_moves(accesses, room, prefetch):
    chunk, nm = 1000, [3] * len(accesses)
    budget = room * chunk + 10  # the Placer holds back 0.1% of it (here: room chunks still fit)
    record = WarmupRecord(tuple((c,) for c in accesses), tuple(nm), (chunk,) * 5)
    p, moves = placer(cfx.gemini.auto(budget, prefetch=prefetch), [chunk] * 5, record)
    run(p, accesses)
    steps = plan_auto(record.accesses, chunk, nm, budget - p.reserve, prefetch=prefetch)
    want = []
    for step in steps:
        want += [("evict", c) for c in step.evict] + [("fetch", c) for c in step.fetch]
    assert moves == want
    assert len(p.resident) <= room and len(p.resident) * chunk + 3 <= budget - p.reserve


def test_auto_replans_when_the_device_holds_other_chunks():
    record = WarmupRecord(((0,), (1,), (0,)), (0, 0, 0), (10, 10))
    p, moves = placer(cfx.gemini.auto(20_000), [10, 10], record)
    p.resident.add(1)  # not what a plan from an empty device expects
    run(p, [0, 1, 0])
    assert moves == [("fetch", 0)]  # both fit: nothing to move but the missing chunk


def test_a_mapped_tensor_keeps_its_values_in_its_file(tmp_path):
    x = torch.randn(3, 5)
    y = mapped_copy(x, str(tmp_path))
    assert torch.equal(x, y) and y.untyped_storage().filename.startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked at once; the mapping keeps it alive
    y.mul_(2)  # writes go to the mapping
    assert torch.equal(y, 2 * x)
