"""partition: contiguous stages balanced by parameter count or given costs; extras; errors."""
import dataclasses
import itertools

import pytest
from hypothesis import given, strategies as st

import cfx
from cfx._src.pipeline.partition import partition


def gpt2(n_layer=4):
    return cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=256, n_embd=64, n_head=4, n_positions=16)


def test_equal_blocks_split_evenly_with_embeddings_first_and_head_last():
    plan = partition(gpt2(4), 2)
    assert plan.bounds == (0, 2, 4)
    assert [list(plan.blocks(s)) for s in range(2)] == [[0, 1], [2, 3]]
    assert plan.extras(0) == ("wte", "wpe") and plan.extras(1) == ("ln_f", "wte")
    assert plan.tied == ("wte",)
    n = cfx.tree.tree_size(gpt2(4).init(cfx.random.key(0))["blocks"][0])
    assert plan.costs == (n,) * 4  # parameter counts, counted on fake tensors
    one = partition(gpt2(4), 1)
    assert one.extras(0) == ("wte", "wpe", "ln_f") and one.bounds == (0, 4)


def test_costs_move_the_cuts_and_bottleneck_is_minimal():
    plan = partition(gpt2(4), 2, costs=[3, 1, 1, 1])
    assert plan.bounds == (0, 1, 4)
    assert [plan.stage_cost(s) for s in range(2)] == [3, 3]
    assert "stage 1: blocks 1..3 + ln_f, wte" in str(plan)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=7), st.integers(1, 7))
def test_balanced_cut_equals_brute_force(costs, k):
    n = len(costs)
    if k > n:
        return
    model = gpt2(n)
    plan = partition(model, k, costs=costs)
    assert plan.bounds[0] == 0 and plan.bounds[-1] == n
    assert all(a < b for a, b in zip(plan.bounds, plan.bounds[1:]))  # >= 1 block per stage

    def score(bounds):
        seg = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        return max(seg), sum(c * c for c in seg)
    best = min(score((0, *cut, n)) for cut in itertools.combinations(range(1, n), k - 1))
    assert score(plan.bounds) == best


def test_llama_untied_head_is_only_on_the_last_stage():
    model = cfx.models.llama("tiny", vocab_size=64, n_layer=2, hidden_size=32, n_head=4, n_kv_heads=2,
                             intermediate_size=48, max_position_embeddings=16)
    plan = partition(model, 2)
    assert plan.extras(0) == ("embed",) and plan.extras(1) == ("norm", "lm_head") and plan.tied == ()


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="4 stages but the model has only 2 blocks.*at most 2 stages"):
        partition(gpt2(2), 4)
    with pytest.raises(ValueError, match="one per block"):
        partition(gpt2(2), 2, costs=[1.0])
    with pytest.raises(ValueError, match="n_stages must be an integer >= 1"):
        partition(gpt2(2), 0)
    with pytest.raises(ValueError, match="map_blocks"):
        partition(cfx.remat.Chained(gpt2(2), object()), 2)
