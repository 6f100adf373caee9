"""cfx.optim.accumulate: k micro-batches accumulated are one step on the k-times batch."""
import pytest
import torch

import cfx
from cfx import optim


def loss_fn(p, x, y):  # a mean over the batch rows
    h = torch.relu(x @ p["w1"] + p["b1"])
    return torch.nn.functional.cross_entropy(h @ p["w2"], y)


def problem(seed=0, steps=3, batch=24):
    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(6, 8, generator=g) * 0.5, "b1": torch.randn(8, generator=g) * 0.1,
              "w2": torch.randn(8, 3, generator=g) * 0.5}
    xs = torch.randn(steps, batch, 6, generator=g)
    ys = torch.randint(0, 3, (steps, batch), generator=g)
    return params, xs, ys


def schedule():
    return optim.warmup_cosine_decay_schedule(0.02, 0.1, 1, 3)


@pytest.mark.parametrize("make", [
    lambda: optim.lamb(schedule(), weight_decay=0.1),
    lambda: optim.lars(schedule(), weight_decay=1e-3, trust_coefficient=0.02),
    lambda: optim.adamw(schedule(), weight_decay=0.1),
    lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(schedule(), 0.9)),
])
@pytest.mark.parametrize("k", [1, 4])
def test_k_micro_batches_step_as_the_k_times_batch(make, k):
    params, xs, ys = problem()
    big, acc = make(), optim.accumulate(make(), k)
    p_big, p_acc = params, params
    s_big, s_acc = big.init(params), acc.init(params)
    mb = xs.shape[1] // k
    for x, y in zip(xs, ys):
        _, g = cfx.value_and_grad(loss_fn)(p_big, x, y)
        u, s_big = big.update(g, s_big, p_big)
        p_big = optim.apply_updates(p_big, u)
        for m in range(k):
            _, g = cfx.value_and_grad(loss_fn)(p_acc, x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb])
            u, s_acc = acc.update(g, s_acc, p_acc)
            if m < k - 1:  # between steps: no update, and the inner state (moments, schedule count) stays
                assert all(torch.equal(v, torch.zeros_like(v)) for v in cfx.tree.leaves(u))
            p_acc = optim.apply_updates(p_acc, u)
        assert int(s_acc.count) == 0
        cfx.tree.assert_close(p_acc, p_big, rtol=1e-5, atol=1e-6)
        cfx.tree.assert_close(s_acc.inner, s_big, rtol=1e-5, atol=1e-6)
    assert not torch.equal(p_big["w1"], params["w1"])  # it trained


def test_state_counts_micro_batches_and_keeps_its_structure():
    params, xs, ys = problem()
    tx = optim.accumulate(optim.lamb(1e-2), 3)
    state = tx.init(params)
    first = cfx.tree.structure(state)
    for i in range(5):
        _, g = cfx.value_and_grad(loss_fn)(params, xs[0], ys[0])
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
        assert cfx.tree.structure(state) == first and all(isinstance(x, torch.Tensor) for x in cfx.tree.leaves(state))
        assert int(state.count) == (i + 1) % 3
        assert int(state.inner[0].count) == (i + 1) // 3  # the inner Adam moments step once per 3 calls


def test_sums_in_float32_and_updates_in_the_grads_dtype():
    params = {"w": torch.ones(4, dtype=torch.bfloat16)}
    tx = optim.accumulate(optim.sgd(1.0), 4)
    state = tx.init(params)
    assert state.acc["w"].dtype == torch.float32
    for v in [1.0, 2 ** -8, 2 ** -8, 2 ** -8]:  # in bf16, 1 + 2**-8 rounds back to 1: each small one would be lost
        u, state = tx.update({"w": torch.full((4,), v, dtype=torch.bfloat16)}, state, params)
    assert u["w"].dtype == torch.bfloat16
    want = torch.full((4,), -(1.0 + 3 * 2 ** -8) / 4).to(torch.bfloat16)  # the float32 mean, rounded once
    assert torch.equal(u["w"], want) and float(want[0]) != -0.25
    assert float(state.acc["w"].abs().max()) == 0.0  # reset after the step


@pytest.mark.parametrize("bad, match", [
    (lambda: optim.accumulate(optim.sgd(0.1), 0), "every=0"),
    (lambda: optim.accumulate(optim.sgd(0.1), 2.0), "every=2.0"),
    (lambda: optim.accumulate("adam", 2), "not a GradientTransformation"),
])
def test_bad_arguments_say_what_to_pass(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_a_foreign_state_is_refused():
    params = {"w": torch.ones(2)}
    tx = optim.accumulate(optim.sgd(0.1), 2)
    with pytest.raises(ValueError, match="AccumulateState"):
        tx.update(params, optim.sgd(0.1).init(params), params)


@pytest.mark.timeout(180)
def test_a_jitted_step_compiles_once_and_matches_eager():
    """The step-or-sum choice is a torch.where, not a host branch: one graph serves both kinds of call."""
    params, xs, ys = problem(steps=4, batch=8)
    tx = optim.accumulate(optim.lamb(schedule(), weight_decay=0.1), 2)

    def step(p, s, x, y):
        loss, g = cfx.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s, loss

    jstep = cfx.jit(step)
    p_e, s_e, p_j, s_j = params, tx.init(params), params, tx.init(params)
    for x, y in zip(xs, ys):
        p_e, s_e, _ = step(p_e, s_e, x, y)
        p_j, s_j, _ = jstep(p_j, s_j, x, y)
    cfx.tree.assert_close(p_j, p_e, rtol=1e-5, atol=1e-6)
    stats = jstep.stats()
    assert stats.compiles == 1 and stats.recompiles == 0 and stats.calls == 4
