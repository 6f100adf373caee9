"""``cfx.autoshard`` end to end on GPT-2 over data=2,model=2: its plan costs no more than Megatron's
under the cost model and the report says which; under a budget Megatron's plan exceeds it finds
one that fits (for a batch-heavy step by storing weights split over ``data`` and gathering them at
use, ZeRO-3's layout), which still computes the one-device step; a budget nothing meets is refused."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx._src.autoshard.train import megatron_reference

MESH = {"data": 2, "model": 2}


@pytest.fixture(scope="module")
def gpt2():
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_positions=32, n_embd=64, n_head=4)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (8, 33), 0, 64)
    batch = (tokens[:, :-1], tokens[:, 1:])
    return model, params, batch, cfx.value_and_grad(model.loss)(params, *batch)


def check_step(step, params, batch, want) -> None:
    loss, grads = step(step.put(params), *batch)
    torch.testing.assert_close(cfx.device_get(loss), want[0])
    cfx.tree.assert_tree_close(cfx.device_get(grads), want[1])


@pytest.mark.timeout(300)
def test_the_plan_is_megatrons_or_cheaper_and_a_tighter_budget_still_fits(gpt2):
    model, params, batch, want = gpt2
    with cfx.Mesh(MESH) as mesh:
        megatron = megatron_reference(model, mesh)
        step, report = cfx.autoshard(model.loss, mesh, (params, *batch), reference=megatron,
                                     reference_name="Megatron")
        assert report.reference.name == "Megatron"
        assert report.estimated_s <= report.reference.estimated_s * (1 + 1e-9)
        assert report.verdict in ("equal", "cheaper")
        assert f"-> the plan is {report.verdict}" in str(report)
        check_step(step, params, batch, want)

        budget = 0.75 * report.reference.memory_bytes  # below Megatron's bytes per rank
        tight, small = cfx.autoshard(model.loss, mesh, (params, *batch), memory_budget=int(budget),
                                     reference=megatron)
        assert small.memory_bytes <= budget < small.reference.memory_bytes
        check_step(tight, params, batch, want)

        with pytest.raises(ValueError, match=r"on mesh \{'data': 2, 'model': 2\}: no strategy assignment fits "
                                             r"4.00 KiB per rank"):
            cfx.autoshard(model.loss, mesh, (params, *batch), memory_budget="4KiB")


@pytest.mark.timeout(120)
def test_below_data_parallel_bytes_a_batch_heavy_step_stores_weights_split_and_gathers_them():
    """Many rows over small weights: data parallelism is the fastest plan; 10% fewer bytes per
    rank and the search keeps a weight split over ``data``, gathered where it is read (ZeRO-3)."""
    def step(p, x):
        return (torch.relu(x @ p["w1"]) @ p["w2"]).pow(2).mean()
    params = {"w1": torch.randn(128, 512) / 8, "w2": torch.randn(512, 128) / 8}
    x = torch.randn(4096, 128)
    want = cfx.value_and_grad(step)(params, x)
    with cfx.Mesh({"data": 4}) as mesh:
        _, free = cfx.autoshard(step, mesh, (params, x))
        assert free.specs == {"w1": cfx.P(), "w2": cfx.P()} and not free.gathered
        zero3, report = cfx.autoshard(step, mesh, (params, x), memory_budget=int(0.9 * free.memory_bytes))
        assert report.memory_bytes <= 0.9 * free.memory_bytes
        assert report.gathered and all("data" in tuple(report.specs[p].all_axes()) for p in report.gathered)
        assert "stored split and gathered at use (ZeRO-3)" in str(report)
        check_step(zero3, params, (x,), want)


@pytest.mark.timeout(120)
def test_bad_calls_are_refused_with_the_fix(gpt2):
    model, params, (x, y), _ = gpt2
    with cfx.Mesh({"model": 4}) as mesh:
        step, _ = cfx.autoshard(model.loss, mesh, (params, x, y))
        with pytest.raises(ValueError, match=r"batch\[0\] is \(8, 16\).*searched for \(8, 32\)"):
            step(params, x[:, :16], y[:, :16])
        with pytest.raises(ValueError, match="example_args must be a tuple"):
            cfx.autoshard(model.loss, mesh, [params, x, y])
        with pytest.raises(ValueError, match="budget 'lots'"):
            cfx.autoshard(model.loss, mesh, (params, x, y), memory_budget="lots")
        with pytest.raises(ValueError, match=r"param 'wte.w' of shape \(64, 64\) cannot take P\(None, None, 'model'\)"):
            cfx.autoshard(model.loss, mesh, (params, x, y), fixed={"wte.w": cfx.P(None, None, "model")})


@pytest.mark.timeout(120)
def test_a_batch_no_axis_divides_is_named_in_the_report(gpt2):
    model, params, _, _ = gpt2
    tokens = cfx.random.randint(cfx.random.key(2), (3, 8), 0, 64)
    with cfx.Mesh({"data": 2}) as mesh:
        _, report = cfx.autoshard(model.loss, mesh, (params, tokens[:, :-1], tokens[:, 1:]))
    assert report.batch_specs == (cfx.P(), cfx.P())
    assert "batch.0 of shape (3, 7) has no dimension any mesh axis divides" in str(report)
    # priced by the default constants, the estimate says it is no time to expect; a measured model's is
    assert "the default cost model's constants, not this machine's" in report.summary()
    with cfx.Mesh({"data": 2}) as mesh:
        _, measured = cfx.autoshard(model.loss, mesh, (params, tokens[:, :-1], tokens[:, 1:]),
                                    cost=cfx.autoshard.CostModel(measured=True))
    assert "not this machine's" not in measured.summary()
