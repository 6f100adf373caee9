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
