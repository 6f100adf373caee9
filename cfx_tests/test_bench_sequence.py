"""``python -m cfx.bench sequence``: each method's payload per layer equals its formula."""
import pytest

from cfx.bench.sequence import measured_and_formula


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("n", [2, 4])
def test_payload_per_layer_is_the_formula(method, n):
    measured, formula = measured_and_formula(method, n, T=32)
    assert measured == formula
