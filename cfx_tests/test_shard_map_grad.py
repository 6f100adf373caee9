"""Gradients through shard_map equal JAX's (``jax.shard_map``, check_vma=True), on generated programs.

Each example draws a mesh of 1-3 axes, layouts for ``x`` (B, D) and ``w`` (D,) -- ``w`` is split
like ``x``'s second dim and replicated over every other axis -- and a chain of ops over the
collectives (psum, pmean, all_gather, psum_scatter, all_to_all, ppermute, pvary) mixed with
values that meet ``w`` again (replicated or not). The same program runs in cfx and in JAX on 8
host CPU devices; the loss and the gradients w.r.t. ``x`` and ``w`` must agree in float64.
"""
import math
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as JP  # noqa: E402

import cfx  # noqa: E402
from cfx import P  # noqa: E402
from cfx_tests.budget import examples  # noqa: E402

jax.config.update("jax_enable_x64", True)
pytestmark = pytest.mark.timeout(300)
NAMES = ("a", "b", "c")


class Lib:
    """The ops a program uses, in one framework's spelling."""

    def __init__(self, jax_side: bool):
        if jax_side:
            lax = jax.lax
            self.tanh, self.sum = jnp.tanh, jnp.sum
            self.psum, self.pmean, self.pvary = lax.psum, lax.pmean, lambda x, a: lax.pcast(x, a, to="varying")
            self.all_gather = lambda x, a: lax.all_gather(x, a, axis=0, tiled=True)
            self.psum_scatter = lambda x, a: lax.psum_scatter(x, a, scatter_dimension=0, tiled=True)
            self.all_to_all = lambda x, a: lax.all_to_all(x, a, 0, 0, tiled=True)
            self.ppermute = lax.ppermute
        else:
            lax = cfx.lax
            self.tanh, self.sum = torch.tanh, torch.sum
            self.psum, self.pmean, self.pvary = lax.psum, lax.pmean, lax.pvary
            self.all_gather = lambda x, a: lax.all_gather(x, a, dim=0, tiled=True)
            self.psum_scatter = lambda x, a: lax.psum_scatter(x, a, dim=0, tiled=True)
            self.all_to_all = lambda x, a: lax.all_to_all(x, a, split_dim=0, concat_dim=0)
            self.ppermute = lax.ppermute


def run(lib, program, mesh_shape, x, w):
    """The per-rank body: ``h = x * w``, the program's ops on ``h``, then a replicated scalar."""
    h = x * w
    for op, axes in program:
        n = math.prod(mesh_shape[a] for a in axes)
        if op == "tanh":
            h = lib.tanh(h)
        elif op == "mul_w":
            h = h * w
        elif op == "add_psum_w":  # a reduced (replicated) value meets a varying one
            h = h + lib.psum(lib.sum(w * w), axes)
        elif op == "psum":
            h = lib.psum(h, axes)
        elif op == "pmean":
            h = lib.pmean(h, axes)
        elif op == "pvary":
            h = lib.pvary(h, axes)
        elif op == "all_gather":
            h = lib.all_gather(h, axes)
        elif op == "psum_scatter":
            h = lib.psum_scatter(h, axes)
        elif op == "all_to_all":
            h = lib.all_to_all(h, axes)
        elif op == "ppermute":
            h = lib.ppermute(h, axes, [(i, (i + 1) % n) for i in range(n)])
        elif op == "final":  # JAX's psum takes axes that all vary, or none: pvary the rest first
            loss = lib.sum(h * h) + lib.sum(w * w)
            return lib.psum(lib.pvary(loss, axes) if axes else loss, tuple(mesh_shape))
    raise AssertionError("a program ends with 'final'")


@st.composite
def problems(draw):
    """A mesh, layouts and a program that JAX's vma typing accepts (psum over axes that all vary
    or none do; pvary only over axes that do not vary yet); cfx runs it unchanged."""
    k = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(k)]
    while math.prod(sizes) > 8:
        sizes[sizes.index(max(sizes))] -= 1
    mesh_shape = dict(zip(NAMES, sizes))
    names = list(mesh_shape)
    w_axes = tuple(a for a in names if draw(st.booleans()))           # w (and x's dim 1) split over these
    rest = [a for a in names if a not in w_axes]
    x_axes = tuple(a for a in rest if draw(st.booleans()))            # x's dim 0 split over these
    D = math.prod(mesh_shape[a] for a in w_axes) * draw(st.integers(1, 2))
    B = math.prod(mesh_shape.values()) * math.prod(mesh_shape[a] for a in x_axes)
    r = B // math.prod(mesh_shape[a] for a in x_axes)                # rows of the block h
    vma = set(x_axes) | set(w_axes)                                    # what h varies over

    def uniform(axes, over):  # all of ``axes`` vary in ``over``, or none
        return set(axes) <= over or not set(axes) & over
    program = []
    for _ in range(draw(st.integers(1, 4))):
        axes = tuple(draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True)))
        ops = ["tanh", "mul_w", "ppermute", "all_gather", "psum_scatter", "all_to_all"]
        ops += ["psum", "pmean"] if uniform(axes, vma) else []
        ops += ["add_psum_w"] if uniform(axes, set(w_axes)) else []
        ops += ["pvary"] if not set(axes) & vma else []
        op = draw(st.sampled_from(ops))
        if op in ("all_gather", "psum_scatter", "all_to_all", "ppermute"):
            axes = axes[:1]  # one axis: the same group order in both frameworks
            if op in ("psum_scatter", "all_to_all") and r % mesh_shape[axes[0]]:
                op = "all_gather"
        n = math.prod(mesh_shape[a] for a in axes)
        r = r * n if op == "all_gather" else r // n if op == "psum_scatter" else r
        if op in ("psum", "pmean"):
            vma -= set(axes)
        elif op == "mul_w":
            vma |= set(w_axes)
        elif op == "add_psum_w":
            vma |= set(w_axes) - set(axes)
        elif op != "tanh":
            vma |= set(axes)
        program.append((op, axes))
    final = vma | set(w_axes)
    program.append(("final", tuple(a for a in names if a not in final) if final else ()))
    return mesh_shape, x_axes, w_axes, (B, D), program


def spec(*dims):
    return [d if d else None for d in dims]


def jax_result(problem, x, w):
    mesh_shape, x_axes, w_axes, _, program = problem
    names = tuple(mesh_shape)
    devices = np.array(jax.devices()[:math.prod(mesh_shape.values())])
    mesh = jax.sharding.Mesh(devices.reshape(tuple(mesh_shape.values())), names,
                             axis_types=(AxisType.Auto,) * len(names))
    f = jax.shard_map(lambda x, w: run(Lib(True), program, mesh_shape, x, w), mesh=mesh,
                      in_specs=(JP(*spec(x_axes, w_axes)), JP(*spec(w_axes))), out_specs=JP())
    loss, grads = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()))
    return float(loss), [torch.from_numpy(np.array(g)) for g in grads]


def cfx_result(problem, x, w, *, sharded_w: bool):
    mesh_shape, x_axes, w_axes, _, program = problem
    with cfx.Mesh(mesh_shape) as mesh:
        f = cfx.shard_map(lambda x, w: run(Lib(False), program, mesh_shape, x, w), mesh=mesh,
                          in_specs=(P(*spec(x_axes, w_axes)), P(*spec(w_axes))), out_specs=P())
        w_in = cfx.device_put(w, mesh, P(*spec(w_axes))) if sharded_w else w
        loss, grads = cfx.value_and_grad(f, argnums=(0, 1))(x, w_in)
        if sharded_w:
            assert isinstance(grads[1], cfx.ShardedArray) and grads[1].spec == P(*spec(w_axes))
        return float(loss), [cfx.device_get(g) for g in grads]


@examples(ci=5)
@given(problems(), st.booleans())
def test_gradients_through_shard_map_equal_jax(problem, sharded_w):
    B, D = problem[3]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 0.5
    w = torch.randn(D, generator=g, dtype=torch.float64) * 0.5
    want_loss, want = jax_result(problem, x, w)
    loss, got = cfx_result(problem, x, w, sharded_w=sharded_w)
    assert loss == pytest.approx(want_loss, rel=1e-10)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)


def test_replicated_input_after_a_psum_is_not_summed_twice():
    # JAX: w meets only the (replicated) psum result, so its cotangent is not summed over "a"
    problem = ({"a": 2}, ("a",), (), (4, 3), [("psum", ("a",)), ("mul_w", ("a",)), ("final", ())])
    x, w = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) / 10, torch.tensor([0.5, -1.0, 2.0],
                                                                                    dtype=torch.float64)
    want_loss, want = jax_result(problem, x, w)
    loss, got = cfx_result(problem, x, w, sharded_w=False)
    assert loss == pytest.approx(want_loss)
    torch.testing.assert_close(got[1], want[1])
