"""``python -m cfx.bench moe``: the expert-parallel exchange sends exactly the routed rows (no padding,
nothing twice), and the uniform-routing formula is met within the routing's imbalance."""
from cfx.bench import moe


def test_the_exchange_sends_exactly_the_rows_that_leave():
    rows = {r["metric"].split(" (")[0].strip(): r for r in moe.run(smoke=True)["rows"]}
    assert rows["over the rows this routing sent off-rank"]["value"] == 1.0
    assert 0.75 < rows["alltoall_bytes_vs_formula"]["value"] < 1.25
    assert rows["expert_load_imbalance"]["value"] >= 1.0
