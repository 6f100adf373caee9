"""The engine's paged attention on a CPU (``cfx._src.serve.paged``): rows gathered into scratch memory reused
across layers and steps, in up to two groups by how many blocks they read -- each row's output is its causal
attention over its own keys alone (fp64), however the rows were grouped; and ``attention="auto"`` on a GPU
running whichever of the kernel and the reference measured faster (``paged_choice``)."""
from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

import cfx
from cfx._src.serve import paged, paged_choice
from cfx._src.serve.paged import KVPool, PagedStep, row_groups
from cfx.serve import Engine, SamplingParams
from cfx_kernels.paged_attention import gather_blocks
from cfx_tests.budget import examples
from cfx_tests.test_kernels_paged_attention import paged_inputs, per_row


def step_over(kp, tables, starts, lengths, T):
    pool = KVPool(kp.shape[0], kp.shape[1], 1)
    return PagedStep(pool, tables, starts, lengths, T, impl="reference"), pool


@examples(ci=6)
@example(rows=[(0, 3), (80, 1), (2, 1), (85, 2)], heads=(4, 1), seed=0)  # two groups (checked below)
@given(rows=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 6)), min_size=1, max_size=6),
       heads=st.sampled_from([(2, 2), (4, 1)]), seed=st.integers(0, 99))
def test_each_row_attends_its_own_keys_in_whatever_group(rows, heads, seed):
    before, news = [r[0] for r in rows], [r[1] for r in rows]
    (q, kp, vp, tables, starts, lengths), (q64, k, v, totals) = paged_inputs(before, news, *heads, 8, 4,
                                                                                dtype=torch.float64, seed=seed)
    step, _ = step_over(kp, tables, starts, lengths, q.shape[1])
    got = step.attend_reference(q, kp, vp)
    if before == [0, 80, 2, 85]:
        assert len(step._groups) == 2
    real = torch.arange(q.shape[1])[None, :] < lengths[:, None]  # (padding tokens' outputs are zeros)
    torch.testing.assert_close(got * real[..., None, None], per_row(q64, k, v, before, news, totals),
                               rtol=1e-12, atol=1e-12)
    assert not got[~real].any()


def test_a_short_row_beside_long_ones_is_grouped_apart():
    tables = torch.arange(40).reshape(4, 10)
    seen = torch.tensor([3, 40, 38, 4])  # two rows of one block, two of ten (blocks of 4)
    allowed = torch.ones(4, 1, 40, dtype=torch.bool)
    groups = row_groups(tables, seen, allowed, 4)
    assert [g.rows.tolist() for g in groups] == [[0, 3], [1, 2]]
    assert [tuple(g.tables.shape) for g in groups] == [(2, 1), (2, 10)]
    assert len(row_groups(tables, torch.tensor([36, 40, 38, 33]), allowed, 4)) == 1  # nothing to save


def test_the_gather_reuses_its_scratch_memory():
    (q, kp, vp, tables, starts, lengths), _ = paged_inputs([5, 9], [1, 1], 2, 2, 8, 4, dtype=torch.float64)
    pool = KVPool(kp.shape[0], kp.shape[1], 1)
    first = pool.gather(kp, tables, 0)
    torch.testing.assert_close(first, gather_blocks(kp, tables), rtol=0, atol=0)
    again = pool.gather(vp, tables[:1], 0)  # fewer rows: the same memory
    assert again.data_ptr() == first.data_ptr()
    torch.testing.assert_close(again, gather_blocks(vp, tables[:1]), rtol=0, atol=0)


def test_auto_runs_what_measured_faster_once_per_kind_of_step(monkeypatch):
    # the measurement (the kernel under the interpreter, on tiny shapes): both timed, the faster chosen
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    choice, times = paged_choice.measure(torch.device("cpu"), torch.float32, 2, 1, 16, 16, paged.attend_reference,
                                         rows=2, context=20, new=1, repeats=1)
    assert set(times) == {"triton", "reference"} and choice == min(times, key=times.get)
    calls = []
    monkeypatch.setattr(paged_choice, "CHOSEN", {})
    monkeypatch.setattr(paged_choice, "measure", lambda *a, **kw: calls.append(kw) or ("triton", {}))
    kp, ref = torch.zeros(10, 16, 2, 16), paged.attend_reference
    assert paged_choice.choose(torch.zeros(3, 1, 4, 16), kp, ref) == paged_choice.choose(torch.zeros(5, 1, 4, 16), kp, ref)
    assert [c["new"] for c in calls] == [1]  # measured once, then remembered
    paged_choice.choose(torch.zeros(1, 7, 4, 16), kp, ref)  # a prefill is a kind of its own
    assert [c["new"] for c in calls] == [1, paged_choice.PREFILL["new"]]


def test_a_cpu_engine_measures_nothing(monkeypatch):
    monkeypatch.setattr(paged, "choose", lambda *a: (_ for _ in ()).throw(AssertionError("measured on a CPU")))
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_embd=32, n_head=2)
    engine = Engine(model, model.init(cfx.random.key(0)), block_size=4, num_blocks=16, max_seqs=2)
    assert len(engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3))[0][0]) == 3
