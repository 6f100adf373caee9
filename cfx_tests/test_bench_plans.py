"""The plans bench's measurement on one plan: booked model-state bytes against Plan.describe,
a step time, and payload on every axis the plan splits over (``python -m cfx.bench plans``)."""
import pytest

import cfx
from cfx.bench import plans


@pytest.mark.timeout(120)
def test_a_3d_plan_measures_what_describe_says():
    model = cfx.models.gpt2("tiny", n_layer=2, n_embd=64, vocab_size=256, n_positions=32)
    m = plans.measure("pipe=2,data=2,model=2 zero=1 microbatches=2", model, 8, 32, 1)
    assert 0.9 <= m["measured"] / m["described"] <= 1.1
    assert m["step_s"] > 0
    assert {"data", "model", "pipe"} <= set(m["sent"]) and m["sent"]["model"] > 0 and m["sent"]["pipe"] > 0


@pytest.mark.timeout(120)
def test_offload_under_a_pipeline_holds_what_describe_says():
    # a later microbatch's gradient piece of a layer reaches the host beside the sum of the earlier ones (was
    # 1.11x describe's figure; left: a few hundred bytes of the layer's piece the measured peak does not hold)
    model = cfx.models.gpt2("tiny", n_layer=2, n_embd=64, vocab_size=256, n_positions=32)
    m = plans.measure("pipe=2,data=2 zero=3 offload=host microbatches=2", model, 8, 32, 1)
    assert m["measured"] / m["described"] == pytest.approx(1, abs=2e-3)
