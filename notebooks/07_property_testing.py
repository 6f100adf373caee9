# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Property-testing your own sharded code
#
# A sharded program should compute exactly what its single-device version computes, on every
# mesh and every layout it accepts. `cfx.testing` provides hypothesis strategies for mesh shapes
# (`meshes`), valid specs (`specs_for`) and shapes that fit a mesh (`divisible_shapes`), plus
# `assert_matches_reference`, which runs a per-rank function under `shard_map` and compares it
# with a reference. Here we prove a hand-written row-parallel matmul (the second half of
# Megatron's MLP, Shoeybi et al. 2019, Fig. 3a) and its gradient correct, and watch the same
# check catch a version with the all-reduce forgotten.

# %%
import math

import torch
from hypothesis import given, settings, strategies as st

import cfx
from cfx import P

# %% [markdown]
# ## The user's function
# `y = x @ w` with the contraction dim `K` split over a mesh axis: each rank multiplies its
# `(B, K/n)` slice of `x` by its `(K/n, N)` rows of `w`, and a `psum` adds the partial products.


# %%
def row_parallel_matmul(axis):
    def per_rank(x_blk, w_blk):  # (B, K/n), (K/n, N) -> (B, N) partial sums, then summed
        return cfx.lax.psum(x_blk @ w_blk, axis)
    return per_rank


def reference(x, w):
    return x @ w


# %% [markdown]
# ## The property
# For any mesh of 2 to 4 ranks, any of its axes with more than one rank as the contraction axis,
# and any valid split of the batch dim over the remaining axes, the sharded result equals the
# reference.

# %%
@st.composite
def problems(draw):
    mesh_shape = draw(cfx.testing.meshes(max_ranks=4).filter(lambda m: math.prod(m.values()) > 1))
    axis = draw(st.sampled_from([a for a, n in mesh_shape.items() if n > 1]))
    B, K = draw(cfx.testing.divisible_shapes(mesh_shape, ndim=2))
    others = {a: n for a, n in mesh_shape.items() if a != axis}
    batch_spec = draw(cfx.testing.specs_for((B,), others)) if others else P()
    return mesh_shape, axis, (B, K), batch_spec


def check(make_per_rank, mesh_shape, axis, shape, batch_spec):
    (B, K), g = shape, torch.Generator().manual_seed(0)
    x, w = torch.randn(B, K, generator=g), torch.randn(K, 3, generator=g)
    batch = batch_spec[0] if len(batch_spec) else None  # None, an axis or a tuple of axes
    with cfx.Mesh(mesh_shape) as mesh:
        cfx.testing.assert_matches_reference(
            make_per_rank(axis), reference, (x, w), mesh=mesh,
            in_specs=(P(batch, axis), P(axis, None)), out_specs=P(batch))


# %%
seen = []


@settings(max_examples=5, deadline=None, derandomize=True)
@given(problems())
def test_row_parallel_matmul(problem):
    seen.append(problem)
    check(row_parallel_matmul, *problem)


test_row_parallel_matmul()
for mesh_shape, axis, shape, batch_spec in seen:
    print(f"mesh {mesh_shape}  K split over {axis!r}  x {shape}  batch spec {batch_spec}: ok")

# %% [markdown]
# ## Gradients too
# The per-rank body may differentiate through the collective: `psum`'s transpose makes each rank's
# gradient of `w` its own rows of the gradient for its batch shard; a `psum` over the batch axes
# (data parallelism's gradient sync) completes it. The result must equal `grad` of the
# single-device loss.


# %%
def grad_of_w(axis, batch):
    def per_rank(x_blk, w_blk):
        g = cfx.grad(lambda w: row_parallel_matmul(axis)(x_blk, w).pow(2).sum())(w_blk)  # (K/n, N)
        return cfx.lax.psum(g, batch) if batch else g
    return per_rank


def reference_grad(x, w):
    return cfx.grad(lambda w: (x @ w).pow(2).sum())(w)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(problems())
def test_row_parallel_grad(problem):
    mesh_shape, axis, (B, K), batch_spec = problem
    batch = batch_spec[0] if len(batch_spec) else None
    x, w = torch.randn(B, K), torch.randn(K, 3)
    with cfx.Mesh(mesh_shape) as mesh:
        cfx.testing.assert_matches_reference(
            grad_of_w(axis, batch), reference_grad, (x, w), mesh=mesh,
            in_specs=(P(batch, axis), P(axis, None)), out_specs=P(axis, None), rtol=1e-5, atol=1e-5)


test_row_parallel_grad()
print("gradient property holds")

# %% [markdown]
# ## A bug the property catches
# Forget the `psum` and each rank returns only its partial product. On any mesh where the
# contraction axis has more than one rank that product varies over the axis, while the out_spec
# `P(batch)` says it is the same on every rank there: `shard_map` refuses it (its replication
# check, on by default) before the comparison even runs, and hypothesis reports the smallest
# failing mesh it found. (With `check_rep=False` the comparison with the reference would catch it.)


# %%
def forgot_psum(axis):
    return lambda x_blk, w_blk: x_blk @ w_blk


@settings(max_examples=5, deadline=None, derandomize=True)
@given(problems())
def test_forgot_psum(problem):
    check(forgot_psum, *problem)


try:
    test_forgot_psum()
    raise RuntimeError("the property should have failed")
except ValueError as e:
    print("caught:", str(e).splitlines()[0])
    print(*getattr(e, "__notes__", []), sep="\n")
