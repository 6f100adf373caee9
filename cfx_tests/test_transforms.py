"""cfx.grad / value_and_grad / vmap / jvp against closed-form derivatives and torch.autograd."""
import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, strategies as st

import cfx


def loss(params, x):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"]).pow(2).mean()


def make(seed=0, d=5, h=7):
    k = cfx.random.split(cfx.random.key(seed), 3)
    params = {"w1": cfx.random.normal(k[0], (d, h)), "b1": torch.zeros(h), "w2": cfx.random.normal(k[1], (h, 1))}
    return params, cfx.random.normal(k[2], (4, d))


def reference_grads(params, x):
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss(p, x).backward()
    return {k: v.grad for k, v in p.items()}


@given(seed=st.integers(0, 1000))
def test_grad_matches_backward(seed):
    params, x = make(seed)
    cfx.tree.assert_tree_close(cfx.grad(loss)(params, x), reference_grads(params, x))
    assert not any(v.requires_grad for v in params.values())  # inputs untouched


def test_closed_form_and_argnums():
    f = lambda a, b: (a * a * b).sum()
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    ga, gb = cfx.grad(f, argnums=(0, 1))(a, b)
    torch.testing.assert_close(ga, 2 * a * b)
    torch.testing.assert_close(gb, a * a)
    v, g = cfx.value_and_grad(f, argnums=1)(a, b)
    torch.testing.assert_close(v, torch.tensor(23.0))
    torch.testing.assert_close(g, a * a)
    assert not v.requires_grad


def test_has_aux_and_unused_leaves_get_zeros():
    f = lambda p: (p["used"].sum() * 2, {"n": p["used"].numel()})
    (v, aux), g = cfx.value_and_grad(f, has_aux=True)({"used": torch.ones(3), "unused": torch.ones(2)})
    assert aux == {"n": 3}
    torch.testing.assert_close(g["unused"], torch.zeros(2))
    g2, aux2 = cfx.grad(f, has_aux=True)({"used": torch.ones(3), "unused": torch.ones(2)})
    torch.testing.assert_close(g2["used"], torch.full((3,), 2.0))


def test_second_order():
    f = lambda x: (x ** 3).sum()
    x = torch.tensor([1.0, -2.0])
    gg = cfx.grad(lambda y: cfx.grad(f)(y).sum())(x)
    torch.testing.assert_close(gg, 6 * x)


def test_grad_under_non_reentrant_checkpoint():
    params, x = make(1)

    def ckpt_loss(p, x):
        h = torch.utils.checkpoint.checkpoint(lambda p_, x_: torch.tanh(x_ @ p_["w1"] + p_["b1"]), p, x,
                                              use_reentrant=False)
        return (h @ p["w2"]).pow(2).mean()
    cfx.tree.assert_tree_close(cfx.grad(ckpt_loss)(params, x), reference_grads(params, x))


def test_grad_under_saved_tensors_hooks():
    params, x = make(2)
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t.clone()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        g = cfx.grad(loss)(params, x)
    assert packed, "hooks were not called"
    cfx.tree.assert_tree_close(g, reference_grads(params, x))


def test_vmap_and_jvp():
    params, x = make(3)
    per_example = cfx.vmap(lambda xi: loss(params, xi[None]))(x)
    torch.testing.assert_close(per_example, torch.stack([loss(params, xi[None]) for xi in x]))
    f = lambda a: torch.sin(a) * a
    a, t = torch.randn(4, generator=torch.Generator().manual_seed(0)), torch.ones(4)
    out, tan = cfx.jvp(f, (a,), (t,))
    torch.testing.assert_close(tan, torch.cos(a) * a + torch.sin(a))


def test_bad_input():
    with pytest.raises(ValueError, match=r"scalar.*Reduce it first, or take the Jacobian \(cfx.jacrev\)"):
        cfx.grad(lambda x: x * 2)(torch.ones(3))
    assert torch.equal(cfx.jacrev(lambda x: x * 2)(torch.ones(3)), 2 * torch.eye(3))  # the hint's function exists
    with pytest.raises(ValueError, match=r"'ids'"):
        cfx.grad(lambda p: p["w"].sum())({"w": torch.ones(2), "ids": torch.arange(3)})
    with pytest.raises(ValueError, match="argnums"):
        cfx.grad(lambda x: x.sum(), argnums=2)(torch.ones(2))
    with pytest.raises(ValueError, match="structure"):
        cfx.jvp(lambda a: a["x"], ({"x": torch.ones(1)},), ({"y": torch.ones(1)},))


def test_is_abstract_fast_path_agrees_with_is_fake():
    # is_abstract answers a plain tensor without is_fake; every kind of tensor must get is_fake's answer
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from cfx._src.transforms.shapes import any_abstract, is_abstract

    real = torch.ones(3)
    with FakeTensorMode():
        fake = torch.ones(3)
    seen = []
    cfx.vmap(lambda x: seen.append(x) or x)(torch.ones(2, 3))  # a functorch-wrapped (batched) tensor
    kinds = {"real": real, "meta": torch.ones(3, device="meta"), "fake": fake, "batched": seen[0],
             "functional real": torch._to_functional_tensor(real), "functional fake": torch._to_functional_tensor(fake),
             "int": 3, "none": None}
    want = {k: isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t)) for k, t in kinds.items()}
    assert {k: is_abstract(t) for k, t in kinds.items()} == want
    assert want["fake"] and want["functional fake"] and not want["functional real"]  # the cases are the ones meant
    for k, t in kinds.items():
        assert any_abstract([real, t]) == want[k], k
    assert not any_abstract([]) and not any_abstract([real, real])


@pytest.mark.parametrize("kind", ["plain", "nested", "unused"])
def test_value_and_grad_of_plain_float_params_equals_the_leafwise_path(kind):
    # plain float leaves take value_and_grad's fast path; its results are the reference's
    params, x = make(1)
    if kind == "nested":  # inputs that require grad (an outer grad): the general path
        params = {k: v.clone().requires_grad_() for k, v in params.items()}
    f = loss if kind != "unused" else (lambda p, x: loss({**p, "w2": p["w2"].detach()}, x))
    value, grads = cfx.value_and_grad(f)(params, x)
    want = reference_grads({k: v.detach() for k, v in params.items()}, x)
    if kind == "unused":
        want["w2"] = torch.zeros_like(params["w2"])
    torch.testing.assert_close(value, loss(params, x).detach())
    cfx.tree.assert_tree_close(grads, want)
    assert value.grad_fn is None if kind != "nested" else value.requires_grad
