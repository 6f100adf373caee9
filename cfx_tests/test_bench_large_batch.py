"""``python -m cfx.bench large_batch``: its rows, its data, its schedule, and that batch 4096 by
accumulation is batch 4096. (LAMB's and LARS's trust ratios over whole leaves are checked against the
papers in test_optim.py, and over ZeRO and tensor-parallel shards in test_plan.py.)"""
import pytest
import torch

import cfx
from cfx.bench import large_batch as lb


@pytest.mark.timeout(120)
def test_smoke_run_yields_every_row(tmp_path):
    out = lb.run(smoke=True, json_path=str(tmp_path / "lb.json"))
    names = [r["metric"] for r in out["rows"]]
    epochs, batches, seeds, optimizers = lb.SIZES["smoke"]
    for name in optimizers:
        for b in batches:
            assert f"{name} batch {b}: test accuracy" in names
        assert f"{name}_largest_vs_small_baseline" in names
    assert "lamb_largest_vs_best_small" in names
    row = {r["metric"]: r for r in out["rows"]}
    gap = row["lamb batch 4096: test accuracy"]["value"] - row["lamb batch 64: test accuracy"]["value"]
    assert row["lamb_largest_vs_small_baseline"]["value"] == pytest.approx(gap, abs=0.011)
    assert row["lamb_largest_vs_small_baseline"]["ok"] == (gap >= -1.0)


def test_the_split_is_fixed_and_disjoint():
    x_tr, y_tr, x_te, y_te = lb.digits()
    assert x_tr.shape == (1347, 8, 8) and x_te.shape == (450, 8, 8) and set(y_te.tolist()) == set(range(10))
    again = lb.digits()
    assert torch.equal(again[0], x_tr) and torch.equal(again[3], y_te)
    train_rows = {tuple(r) for r in x_tr.flatten(1).tolist()}
    assert not any(tuple(r) in train_rows for r in x_te.flatten(1).tolist())  # no test image is also trained on


def test_warmup_is_the_same_steps_at_every_batch_and_the_rates_follow_the_papers():
    epochs, n = 150, 1347
    for b in (64, 256, 1024, 4096):
        steps = round(epochs * n / b)
        for name, power in (("lamb", 0.5), ("lars", 1.0)):
            r = lb.RECIPES[name]
            s = lb.schedule_for(r, b, steps)
            peak = r.base_lr * (b / 64) ** power
            assert s(10) == pytest.approx(peak, rel=1e-6) and s(9) < peak  # 10 warm-up steps, whatever the batch
            assert s(0) == 0.0 and s(steps) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.timeout(120)
def test_batch_4096_by_accumulation_is_batch_4096():
    data = lb.digits()
    acc = lb.train(lb.RECIPES["lamb"], 4096, epochs=10, seed=0, data=data)           # 4 micro-batches of 1024
    whole = lb.train(lb.RECIPES["lamb"], 4096, epochs=10, seed=0, data=data, micro=4096)  # one forward
    assert acc["steps"] == whole["steps"] == 3
    cfx.tree.assert_close(acc["params"], whole["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_trust_ratios_keep_the_linear_scaled_rate_that_sgd_cannot_take():
    """At batch 4096 the linear rule asks 64x batch 64's learning rate: LARS's per-layer ratio keeps
    the steps in scale with the weights and trains; plain momentum SGD at its own scaled rate diverges."""
    data = lb.digits()
    lars = lb.train(lb.RECIPES["lars"], 4096, epochs=150, seed=0, data=data)
    sgd = lb.train(lb.RECIPES["sgd"], 4096, epochs=150, seed=0, data=data)
    assert lars["accuracy"] > 95.0 and sgd["accuracy"] < 30.0
