"""JAX's transform idioms compose in cfx as they do in JAX: ``cfx.vmap(cfx.grad(f))`` (per-example
gradients), ``vmap`` of ``value_and_grad``, ``jvp`` of ``grad``, ``jacrev`` / ``jacfwd`` / ``hessian`` over
pytrees -- each equal, in float64, to a loop of ``cfx.grad`` over the examples, to ``torch.func``, and to
JAX's own transforms of the same function on drawn shapes."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

import cfx  # noqa: E402
from cfx_tests.budget import examples  # noqa: E402

jax.config.update("jax_enable_x64", True)


def loss(lib, params, x):
    """A small MLP's squared error on one example ``x`` (D,): tanh hidden layer, a bias, a norm term."""
    h = lib.tanh(x @ params["w1"] + params["b"])
    return ((h @ params["w2"]) ** 2).sum() + 0.1 * (params["w1"] ** 2).sum()


def draw(B: int, D: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(D, H, generator=g, dtype=torch.float64),
              "b": torch.randn(H, generator=g, dtype=torch.float64),
              "w2": torch.randn(H, 2, generator=g, dtype=torch.float64)}
    return params, torch.randn(B, D, generator=g, dtype=torch.float64)


def to_jax(tree):
    return jax.tree_util.tree_map(lambda t: jnp.asarray(t.numpy()), tree)


def close(ours, theirs):
    for k in theirs:
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(theirs[k]), rtol=1e-12, atol=1e-12)


@examples(ci=4)
@given(B=st.integers(1, 5), D=st.integers(1, 4), H=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_per_example_gradients_equal_a_loop_and_jax(B, D, H, seed):
    params, xs = draw(B, D, H, seed)
    f = lambda p, x: loss(torch, p, x)  # noqa: E731
    per_example = cfx.vmap(cfx.grad(f), in_axes=(None, 0))(params, xs)
    loop = [cfx.grad(f)(params, x) for x in xs]
    close(per_example, {k: torch.stack([g[k] for g in loop]) for k in params})
    theirs = jax.vmap(jax.grad(lambda p, x: loss(jnp, p, x)), in_axes=(None, 0))(to_jax(params), jnp.asarray(xs.numpy()))
    close(per_example, theirs)
    values, grads = cfx.vmap(cfx.value_and_grad(f), in_dims=(None, 0))(params, xs)  # torch's name for the axes
    np.testing.assert_allclose(values.numpy(), [float(f(params, x)) for x in xs], rtol=1e-12)
    close(grads, per_example)


def test_grad_of_vmap_and_jvp_of_grad_compose():
    params, xs = draw(4, 3, 2, 0)
    f = lambda p, x: loss(torch, p, x)  # noqa: E731
    mean_of_vmapped = cfx.grad(lambda p: cfx.vmap(f, in_axes=(None, 0))(p, xs).mean())(params)
    close(mean_of_vmapped, {k: torch.stack([cfx.grad(f)(params, x)[k] for x in xs]).mean(0) for k in params})
    tangent = {k: torch.ones_like(v) for k, v in params.items()}
    _, hvp = cfx.jvp(cfx.grad(lambda p: f(p, xs[0])), (params,), (tangent,))  # Hessian-vector product
    jp, jx = to_jax(params), jnp.asarray(xs[0].numpy())
    _, theirs = jax.jvp(jax.grad(lambda p: loss(jnp, p, jx)), (jp,), (to_jax(tangent),))
    close(hvp, theirs)


def test_jacobians_and_the_hessian_equal_jax():
    params, xs = draw(3, 3, 4, 1)
    x = xs[0]
    out = lambda p: torch.tanh(x @ p["w1"] + p["b"])  # noqa: E731  (H,)
    jout = lambda p: jnp.tanh(jnp.asarray(x.numpy()) @ p["w1"] + p["b"])  # noqa: E731
    jp = to_jax(params)
    for ours in (cfx.jacrev(out)(params), cfx.jacfwd(out)(params)):
        close(ours, jax.jacrev(jout)(jp))
    w1 = params["w1"]
    h = cfx.hessian(lambda w: loss(torch, {**params, "w1": w}, x))(w1)  # (D, H, D, H)
    theirs = jax.hessian(lambda w: loss(jnp, {**jp, "w1": w}, jnp.asarray(x.numpy())))(jp["w1"])
    np.testing.assert_allclose(h.numpy(), np.asarray(theirs), rtol=1e-12, atol=1e-12)


def test_vmap_axes_are_named_once():
    with pytest.raises(ValueError, match="in_dims .* or in_axes .*, not both"):
        cfx.vmap(torch.sin, in_dims=1, in_axes=0)
    with pytest.raises(ValueError, match="out_dims .* or out_axes .*, not both"):
        cfx.vmap(torch.sin, out_dims=1, out_axes=0)
