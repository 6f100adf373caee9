"""``python -m cfx.bench sequence``: each method's payload per layer equals its formula."""
import pytest

from cfx.bench.sequence import measured_and_formula


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,n", [("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4), ("hybrid", 2)])
def test_payload_per_layer_is_the_formula(method, n):
    measured, formula = measured_and_formula(method, n, T=32)
    assert measured == formula


@pytest.mark.timeout(120)
def test_megatron_sp_sends_what_tensor_parallelism_sends():
    from cfx.bench.sequence import megatron_and_tp_wire
    sp, tp = megatron_and_tp_wire(2, T=32)
    assert sp == tp > 0


@pytest.mark.timeout(300)
def test_ring_activations_grow_linearly_and_split_over_the_ranks():
    from cfx.bench.sequence_memory import N, activation_peak
    a, b, c = (activation_peak("ring", T) for T in (256, 512, 1024))
    assert abs((c - b) / (b - a) - 2.0) < 0.2  # O(T) per rank: no (T/N)^2 score block is held
    one = activation_peak("one", 512) - activation_peak("one", 256)
    assert (b - a) * N < 1.5 * one  # each rank's extra tokens cost about 1/N of one device's


@pytest.mark.timeout(300)
def test_longest_sequence_fits_the_budget_and_one_grain_more_does_not():
    from cfx.bench.sequence_memory import GRAIN, activation_peak, longest
    budget = activation_peak("ulysses", 200)
    T = longest("ulysses", budget, 256)
    assert T % GRAIN == 0 and T >= 200
    assert activation_peak("ulysses", T) <= budget < activation_peak("ulysses", T + GRAIN)
