"""The Plan's contract (``cfx/_src/plan/strategy.py``): a strategy is one object in ``STRATEGIES``;
adding one -- here a toy axis that only counts -- is one class and one list entry, and the Program,
``Plan.parse``, ``describe`` and the checks all take it up; every strategy hook the Program has is
asked of it, in the phases the protocol names. The single-device program is the same protocol."""
from __future__ import annotations

import collections

import pytest
import torch

import cfx
from cfx._src.parallel.state import tree_pmean
from cfx._src.plan import strategies
from cfx._src.plan.strategy import Strategy
from cfx.parallel import Plan, TrainProgram
from cfx_tests.test_plan import MODELS, data, reference, run_plan

CALLS: collections.Counter = collections.Counter()


class Count(Strategy):
    """An axis over which every rank holds and computes the same; it averages the gradients over it
    (the identity on equal values) and counts what the Program asks of it."""

    name, axes = "count", ("count",)

    def check(self, plan, model, where):
        CALLS["check"] += 1
        if plan.has("count") and plan.size("count") > 4:
            raise ValueError(f"{where}: count={plan.size('count')}; the toy counts to 4 at most.")

    def parallelize(self, plan, model):
        CALLS["parallelize"] += 1
        return model

    def wrap_block(self, plan, block):
        CALLS["wrap_block"] += 1
        return block

    def reduce(self, plan, grads, built):
        CALLS["reduce"] += 1
        return tree_pmean(grads, "count") if plan.has("count") else grads

    def account(self, plan, acc, built):
        acc.add("counted ranks", plan.size("count"))


@pytest.fixture
def with_count(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(strategies, "STRATEGIES", (*strategies.STRATEGIES, Count()))


def test_a_new_axis_is_one_strategy_and_one_list_entry(with_count):
    plan = Plan.parse("data=2,count=2 zero=1")
    assert str(plan) == "data=2,count=2 zero=1" and plan.size("count") == 2
    losses, params = run_plan(plan, MODELS["gpt2"], cfx.optim.adamw(1e-3), data())
    want_losses, want_params = reference("gpt2")
    torch.testing.assert_close(losses, want_losses)
    cfx.tree.assert_close(params, want_params)
    assert CALLS["check"] >= 1 and CALLS["parallelize"] >= 1
    assert CALLS["wrap_block"] == 4  # each of GPT-2's four blocks, once
    assert CALLS["reduce"] == plan.world_size * len(data())  # every rank's every step
    described = plan.describe(MODELS["gpt2"])
    assert described.bytes["counted ranks"] == 2 and described.tiers["counted ranks"] == "device"
    with pytest.raises(ValueError, match="the toy counts to 4 at most"):
        Plan.parse("count=8").check(MODELS["gpt2"])


def test_without_its_entry_the_axis_is_unknown():
    with pytest.raises(ValueError, match="unknown key 'count'"):
        Plan.parse("data=2,count=2")


def test_every_strategy_has_its_own_module_and_axes():
    names = [s.name for s in strategies.STRATEGIES]
    assert len(set(names)) == len(names)
    owned = [a for s in strategies.STRATEGIES for a in s.axes]
    assert len(set(owned)) == len(owned)  # no axis owned twice
    assert set(owned) == {"pipe", "data", "expert", "seq", "model", "row", "col", "dep"}
    modules = {type(s).__module__ for s in strategies.STRATEGIES}
    assert len(modules) == len(names)


def test_the_single_device_program_is_the_same_protocol():
    model, tx = MODELS["gpt2"], cfx.optim.adamw(1e-3)
    step = Plan().step(model, tx)
    assert isinstance(step, TrainProgram)
    state = step.init(cfx.random.key(0))
    assert state.frozen is None
    losses = []
    for batch in data():
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    want_losses, want_params = reference("gpt2")
    torch.testing.assert_close(torch.stack(losses), want_losses)
    cfx.tree.assert_close(step.params(state), want_params)
    with pytest.raises(ValueError, match="give its step a mesh"):
        Plan.parse("data=2").step(model, tx)
    with pytest.raises(ValueError, match="jit=True compiles a Plan's step on a mesh"):
        Plan().step(model, tx, jit=True)
    with Plan.parse("data=2").make_mesh() as mesh:
        assert isinstance(Plan.parse("data=2").step(model, tx, mesh=mesh), TrainProgram)


def test_remat_auto_is_solved_per_batch_shape_not_by_replacing_the_program():
    model, tx = MODELS["gpt2"], cfx.optim.adamw(1e-3)
    plan = Plan.parse("data=2 remat=auto:512KiB")
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        layout, opt = step.layout, step.opt
        state = step.init(cfx.random.key(0))
        assert step.remat_plan is None
        x = cfx.random.randint(cfx.random.key(3), (B_SHORT, 9), 0, 64)
        state, _ = step(state, (x[:, :-1], x[:, 1:]))
        short = step.remat_plan
        x = cfx.random.randint(cfx.random.key(4), (B_SHORT, 17), 0, 64)
        state, _ = step(state, (x[:, :-1], x[:, 1:]))
        long = step.remat_plan
        assert short is not None and long is not None and short is not long
        assert long.chain.n == short.chain.n == 4
        assert step.layout is layout and step.opt is opt  # the program itself is as built
        x = cfx.random.randint(cfx.random.key(5), (B_SHORT, 9), 0, 64)
        step(state, (x[:, :-1], x[:, 1:]))
        assert step.remat_plan is short  # the first shape's schedule, kept


B_SHORT = 4
