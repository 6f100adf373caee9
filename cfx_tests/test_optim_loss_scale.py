"""cfx.optim.dynamic_loss_scale against torch.amp.GradScaler, with inf/nan injected at drawn steps.

The scale trajectory must equal GradScaler's exactly; a skipped step must leave params and the
inner state untouched; the other steps must equal the inner optimizer on the unscaled grads.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cfx
from cfx import optim

STEPS = 20


def problem(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 2), (4,), ()]
    tree = lambda: {"w": torch.randn(shapes[0], generator=g),  # noqa: E731
                    "rest": [torch.randn(shapes[1], generator=g), torch.randn(shapes[2], generator=g)]}
    return tree(), [tree() for _ in range(STEPS)]


INNER = {
    "sgd": (lambda: optim.sgd(0.1, 0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "adamw": (lambda: optim.adamw(1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
}


def poison(tree, leaf, value):
    xs, treedef = cfx.tree.flatten(tree)
    xs = [x.clone() for x in xs]
    xs[leaf].view(-1)[0] = value
    return cfx.tree.unflatten(treedef, xs)


@given(st.integers(0, 2**31 - 1), st.sets(st.integers(0, STEPS - 1), max_size=8),
       st.sampled_from([float("inf"), float("-inf"), float("nan")]), st.integers(0, 2),
       st.integers(1, 4), st.integers(0, 16), st.sampled_from(sorted(INNER)))
def test_matches_grad_scaler(seed, bad_steps, bad_value, bad_leaf, growth_interval, log2_scale, inner):
    make_ours, make_torch = INNER[inner]
    params, true_grads = problem(seed)
    kw = dict(init_scale=2.0 ** log2_scale, growth_factor=2.0, backoff_factor=0.5,
              growth_interval=growth_interval)

    # torch: a real GradScaler driving a torch optimizer
    leaves, treedef = cfx.tree.flatten(params)
    ps = [p.clone().requires_grad_(True) for p in leaves]
    opt = make_torch(ps)
    scaler = torch.amp.GradScaler("cpu", **kw)
    scaler.scale(torch.ones(()))  # initialises the scaler's scale tensor

    # cfx: the same scaled grads through dynamic_loss_scale, and the inner optimizer on clean steps
    tx, inner_tx = optim.dynamic_loss_scale(make_ours(), **kw), make_ours()
    state, inner_state = tx.init(params), inner_tx.init(params)
    plain_params = params

    for k, grads in enumerate(true_grads):
        scaled = cfx.tree.map(lambda g: g * optim.loss_scale(state), grads)
        if k in bad_steps:
            scaled = poison(scaled, bad_leaf, bad_value)
        for p, g in zip(ps, cfx.tree.leaves(scaled)):
            p.grad = g.clone()
        scaler.step(opt)
        scaler.update()

        updates, new_state = tx.update(scaled, state, params)
        new_params = optim.apply_updates(params, updates)
        if k in bad_steps:  # skipped: nothing moves
            cfx.tree.assert_tree_close(new_params, params, rtol=0, atol=0)
            cfx.tree.assert_tree_close(new_state.inner_state, state.inner_state, rtol=0, atol=0)
        else:
            u, inner_state = inner_tx.update(grads, inner_state, plain_params)
            plain_params = optim.apply_updates(plain_params, u)
        params, state = new_params, new_state

        assert float(optim.loss_scale(state)) == scaler.get_scale(), f"step {k}"
        assert int(state.growth_tracker) == int(scaler._growth_tracker), f"step {k}"
        cfx.tree.assert_tree_close(params, cfx.tree.unflatten(treedef, [p.detach() for p in ps]))
        cfx.tree.assert_tree_close(params, plain_params)
    assert int(state.skipped) == len(bad_steps)


@pytest.mark.parametrize("growth_factor, backoff_factor", [(2.0, 0.5), (3.0, 0.3), (1.7, 0.9)])
def test_scale_trajectory_with_other_factors_and_at_the_float32_limit(growth_factor, backoff_factor):
    for init_scale in (2.0 ** 127, 1000.0):  # 2**127 * 2 overflows: the scale must stay put
        kw = dict(init_scale=init_scale, growth_factor=growth_factor,
                  backoff_factor=backoff_factor, growth_interval=1)
        scaler = torch.amp.GradScaler("cpu", **kw)
        scaler.scale(torch.ones(()))
        p = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        tx = optim.dynamic_loss_scale(optim.sgd(0.1), **kw)
        params = {"p": torch.zeros(2)}
        state = tx.init(params)
        for k in range(12):
            g = torch.tensor([1.0, float("inf") if k in (3, 7, 8) else 2.0])
            p.grad = g.clone()
            scaler.step(opt)
            scaler.update()
            _, state = tx.update({"p": g}, state, params)
            assert float(state.scale) == scaler.get_scale(), f"step {k}"


def test_fp16_usage_backs_off_until_grads_fit():
    """The documented recipe: differentiate scale_loss(loss, state) of an fp16 computation."""
    params = {"w": torch.ones(3)}
    tx = optim.dynamic_loss_scale(optim.sgd(1e-3), init_scale=2.0 ** 16)
    state = tx.init(params)
    # d loss / d w = 1e4 per element: times the scale, fp16 overflows (max 65504) while scale > 6.5
    loss_fn = lambda p, s: optim.scale_loss((p["w"].half() * 1e4).sum(), s)  # noqa: E731
    for _ in range(20):
        grads = cfx.grad(loss_fn)(params, state)
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    assert float(optim.loss_scale(state)) == 4.0  # 2**16 halved 14 times
    assert int(state.skipped) == 14
    torch.testing.assert_close(params["w"], torch.full((3,), 1.0 - 6 * 1e-3 * 1e4))


def test_all_finite():
    tree = {"a": torch.ones(3), "b": [torch.ones(2, dtype=torch.bfloat16), None]}
    assert bool(optim.all_finite(tree)) and optim.all_finite(tree).shape == ()
    for leaf in range(2):
        for bad in (float("inf"), float("-inf"), float("nan")):
            assert not bool(optim.all_finite(poison(tree, leaf, bad)))
    assert bool(optim.all_finite({}))
    assert bool(optim.all_finite({"big": torch.full((2,), 3e38)}))


def test_state_and_loss_scale_lookup():
    params = {"w": torch.ones(2)}
    tx = optim.chain(optim.clip_by_global_norm(1.0),
                     optim.dynamic_loss_scale(optim.adamw(1e-3), init_scale=8.0))
    state = tx.init(params)
    inner = state[1]
    assert isinstance(inner, optim.LossScaleState)
    assert inner.scale.dtype == torch.float32 and inner.growth_tracker.dtype == torch.int32
    assert inner.skipped.dtype == torch.int32
    assert float(optim.loss_scale(state)) == 8.0
    torch.testing.assert_close(optim.scale_loss(torch.tensor(1.5), state), torch.tensor(12.0))
    with pytest.raises(ValueError, match="found 0 LossScaleState"):
        optim.loss_scale(optim.adamw(1e-3).init(params))


@pytest.mark.parametrize("kw, match", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
])
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        optim.dynamic_loss_scale(optim.sgd(0.1), **kw)
