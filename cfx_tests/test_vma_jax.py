"""Gradients taken INSIDE a shard_map body, and their varying-axes types, equal JAX's.

Each example draws a small program on a 2x2 ``data`` x ``model`` mesh: a batch ``x``, a weight
``w`` replicated, split by rows (the contraction, with ``x``'s columns) or by columns over
``model``, a bias ``b`` added somewhere in a chain of ops (matmul, ``psum`` / ``pmean`` / tiled
``all_gather`` over an axis, tanh) and a replicated scale ``s``; the body takes ``grad`` of its
scalar loss w.r.t. ``(w, b, s)`` and may ``pmean`` the grads over ``data`` (``tree_pmean`` in cfx,
leafwise ``lax.pmean`` in JAX). Every rank's gradients come back (``P(("data", "model"))``).

* ``check_vma=True`` against ``jax.shard_map(check_vma=True)`` + ``jax.grad``: values, and every
  gradient's type (``cfx.lax.varying_axes`` vs ``jax.typeof(g).mat.varying``): an invariant
  param's cotangent is psum'd over the axes it met varying values on (the implicit pvary's
  transpose).
* ``check_vma=False`` against ``jax.shard_map(check_vma=False)``: no implicit pvary, each rank's
  own partial gradients. cfx's explicit collectives keep their ``check_vma=True`` transposes
  (``psum``'s is the identity: the README's one stated difference), so the JAX side runs psum /
  pmean with that transpose (``_psum_identity_vjp``); the last JAX test pins the difference itself.

Then the two cases issue 46 reported, and ZeRO's stages under ``check_vma=True``.
"""
import os
from collections import Counter

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
MESH = {"data": 2, "model": 2}
EVERY = ("data", "model")
B, D, H = 4, 4, 4


def _psum_identity_vjp(axis):
    """JAX's psum with the check_vma=True transpose (identity) that cfx's psum has in both modes."""
    @jax.custom_vjp
    def f(x):
        return jax.lax.psum(x, axis)
    f.defvjp(lambda x: (jax.lax.psum(x, axis), None), lambda _, g: (g,))
    return f


class Lib:
    """The ops a program uses, in one framework's spelling."""

    def __init__(self, jax_side: bool, check_vma: bool):
        if jax_side:
            if check_vma:
                self.psum, self.pmean = jax.lax.psum, jax.lax.pmean
            else:
                self.psum = lambda x, a: _psum_identity_vjp(a)(x)
                self.pmean = lambda x, a: _psum_identity_vjp(a)(x) / MESH[a]
            self.all_gather = lambda x, a, d: jax.lax.all_gather(x, a, axis=d, tiled=True)
            self.tanh, self.sum = jnp.tanh, jnp.sum
            self.grad = lambda f, p: jax.grad(f)(p)
            self.tree_pmean = lambda t, a: jax.tree.map(lambda g: self.pmean(g, a), t)
            self.vma = (lambda t: jax.typeof(t).mat.varying) if check_vma else (lambda t: None)
        else:
            lax = cfx.lax
            self.psum, self.pmean = lax.psum, lax.pmean
            self.all_gather = lambda x, a, d: lax.all_gather(x, a, dim=d, tiled=True)
            self.tanh, self.sum = torch.tanh, torch.sum
            self.grad = lambda f, p: cfx.grad(f)(p)
            self.tree_pmean = cfx.parallel.tree_pmean
            self.vma = lax.varying_axes if check_vma else (lambda t: None)


def body(lib, program, types, x, w, b, s):
    """Per rank: ``grad`` of the program's loss w.r.t. ``(w, b, s)`` taken here, maybe pmean'd."""
    def loss(params):
        w, b, s = params
        h = x @ w
        for op in program["ops"]:
            if op == "bias":
                h = h + b
            elif op == "tanh":
                h = lib.tanh(h)
            elif op[0] in ("psum", "pmean"):
                h = (lib.psum if op[0] == "psum" else lib.pmean)(h, op[1])
            elif op == "gather_rows":
                h = lib.all_gather(h, "data", 0)
            elif op == "gather_cols":
                h = lib.all_gather(h, "model", 1)
        out = s[0] * lib.sum(h * h)
        return lib.pmean(out, "data") if program["pmean_loss"] else out
    grads = lib.grad(loss, (w, b, s))
    types.append(tuple(lib.vma(g) for g in grads))
    if program["tree_pmean"]:
        grads = lib.tree_pmean(grads, "data")
        types.append(tuple(lib.vma(g) for g in grads))
    return tuple(g[None] for g in grads)  # every rank's, under P(("data", "model"))


@st.composite
def programs(draw):
    """A layout for ``w`` and a chain of ops in which the bias ``b`` is added where ``h`` has its width."""
    w_layout = draw(st.sampled_from(["rep", "row", "col"]))
    split_rows = draw(st.booleans())                              # x's rows over data
    cols_split = w_layout == "col"                                # h's columns are a block over model
    ops, bias_split = [], None
    for _ in range(draw(st.integers(1, 4))):
        choices = ["tanh", ("psum", "model"), ("pmean", "model"), ("psum", "data"), ("pmean", "data"),
                   "gather_rows", "bias"]
        choices += ["gather_cols"] if cols_split else []
        op = draw(st.sampled_from(choices))
        if op == "gather_cols":
            cols_split = False
        if op == "bias":
            if bias_split is not None and bias_split != cols_split:
                continue                                          # b has one width
            bias_split = cols_split
        ops.append(op)
    if bias_split is None:
        ops.append("bias")
        bias_split = cols_split
    return {"w": w_layout, "x": P("data" if split_rows else None, "model" if w_layout == "row" else None),
            "b": P("model") if bias_split else P(), "ops": ops,
            "pmean_loss": draw(st.booleans()), "tree_pmean": draw(st.booleans())}


def _specs(program):
    w = {"rep": P(), "row": P("model", None), "col": P(None, "model")}[program["w"]]
    return program["x"], w, program["b"], P()


def _jp(spec: P):
    return JP(*spec)


def _jax_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), EVERY, axis_types=(AxisType.Auto,) * 2)


def jax_run(program, arrays, check_vma):
    types: list = []
    mesh = _jax_mesh()
    f = jax.shard_map(lambda *a: body(Lib(True, check_vma), program, types, *a), mesh=mesh,
                      in_specs=tuple(_jp(s) for s in _specs(program)), out_specs=JP(EVERY), check_vma=check_vma)
    out = f(*(jnp.asarray(a.numpy()) for a in arrays))
    return [torch.from_numpy(np.array(g)) for g in out], types


def cfx_run(program, arrays, check_vma):
    types: list = []
    with cfx.Mesh(MESH) as mesh:
        f = cfx.shard_map(lambda *a: body(Lib(False, check_vma), program, types, *a), mesh=mesh,
                          in_specs=_specs(program), out_specs=P(EVERY), check_vma=check_vma)
        out = [cfx.device_get(g) for g in f(*arrays)]
    return out, types


def _arrays(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, D, generator=g, dtype=torch.float64) * 0.5,
            torch.randn(D, H, generator=g, dtype=torch.float64) * 0.5,
            torch.randn(H, generator=g, dtype=torch.float64) * 0.5,
            torch.tensor([0.75], dtype=torch.float64))


@examples(ci=6)
@given(programs(), st.booleans())
def test_grads_inside_a_body_equal_jax(program, check_vma):
    arrays = _arrays()
    want, want_types = jax_run(program, arrays, check_vma)
    got, got_types = cfx_run(program, arrays, check_vma)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert Counter(got_types) == Counter(want_types * 4)  # each rank's types, as JAX's (None: untracked)


# -- the two cases reported in issue 46 ---------------------------------------------------------
def _dp_body(lib, x, w, v):
    """Data parallel x a model-split ``w``: grads taken in the body, then pmean'd over data."""
    def loss(p):
        w, v = p
        return lib.sum(lib.tanh(x @ w)) * v[0]
    grads = lib.tree_pmean(lib.grad(loss, (w, v)), "data")
    return grads, tuple(lib.vma(g) for g in grads)


def test_tree_pmean_types_every_leaf_as_leafwise_pmean():
    # (a): after tree_pmean the grads are typed as leafwise pmean types them: v's is invariant (the
    # out_spec P() passes the type check), w's (split over model) varies over model only -- one
    # flat buffer over both would have given each the union
    g = torch.Generator().manual_seed(3)
    x, w, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 3), (3, 2), (1,)))
    in_specs, out_specs = (P("data"), P(None, "model"), P()), (P(None, "model"), P())
    mesh = _jax_mesh()
    seen = []

    def jax_body(x, w, v):
        grads, types = _dp_body(Lib(True, True), x, w, v)
        seen.append(types)
        return grads
    want = jax.shard_map(jax_body, mesh=mesh, in_specs=tuple(map(_jp, in_specs)), out_specs=tuple(map(_jp, out_specs)),
                         check_vma=True)(*(jnp.asarray(a.numpy()) for a in (x, w, v)))
    assert seen == [(frozenset({"model"}), frozenset())]
    with cfx.Mesh(MESH) as cmesh:
        def cfx_body(x, w, v):
            grads, types = _dp_body(Lib(False, True), x, w, v)
            seen.append(types)
            return grads
        got = cfx.shard_map(cfx_body, mesh=cmesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)(x, w, v)
        for a, b in zip(got, want):
            torch.testing.assert_close(cfx.device_get(a), torch.from_numpy(np.array(b)), rtol=1e-9, atol=1e-12)
    assert seen == [seen[0]] * 5


@pytest.mark.parametrize("tree_op", ["tree_pmean", "tree_psum"])
def test_tree_collectives_differentiate_as_their_leafwise_forms(tree_op):
    # differentiated from outside (so tracked), over leaves of three types: the loss, its type and
    # every gradient equal the leafwise collective's (one flat buffer would type and pvary them all
    # by the union, and the out_spec P() would refuse the loss)
    g = torch.Generator().manual_seed(5)
    x, u, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 4), (4,), (3,)))
    leafwise = {"tree_pmean": cfx.lax.pmean, "tree_psum": cfx.lax.psum}[tree_op]

    def body(flat):
        def f(x, u, v):
            t = {"a": x * u, "b": v * v.sum(), "c": cfx.lax.psum(x.sum(), "model") * v}  # data+model, none, data
            r = getattr(cfx.parallel, tree_op)(t, "data") if flat else {k: leafwise(a, "data") for k, a in t.items()}
            assert [sorted(cfx.lax.varying_axes(r[k])) for k in "abc"] == [["model"], [], []]
            return (cfx.lax.psum((r["a"] ** 2).sum(), "model") + (r["b"] ** 3).sum() + (r["c"] ** 2).sum())
        return f
    with cfx.Mesh(MESH) as mesh:
        (got, got_g), (want, want_g) = (
            cfx.value_and_grad(cfx.shard_map(body(flat), mesh=mesh, in_specs=(P("data", "model"), P("model"), P()),
                                             out_specs=P()), argnums=(0, 1, 2))(x, u, v) for flat in (True, False))
        torch.testing.assert_close(cfx.device_get(got), cfx.device_get(want))
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(cfx.device_get(a), cfx.device_get(b))


def test_bias_after_a_psum_has_an_invariant_gradient():
    # (b): b is added after psum(..., "model") of a row-split matmul: its gradient is invariant over
    # both axes (summed over data by the implicit pvary's transpose), w's varies over model
    program = {"w": "row", "x": P("data", "model"), "b": P(), "ops": [("psum", "model"), "bias", "tanh"],
               "pmean_loss": False, "tree_pmean": False}
    arrays = _arrays(1)
    want, want_types = jax_run(program, arrays, True)
    got, got_types = cfx_run(program, arrays, True)
    assert want_types == [(frozenset({"model"}), frozenset(), frozenset())]
    assert set(got_types) == set(want_types)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_psum_transpose_differs_from_jax_check_vma_false():
    # the one stated difference: JAX's check_vma=False transposes psum to a psum (its cotangent
    # summed over the axis), cfx's psum transposes to the identity in both modes (JAX's
    # check_vma=True rule), so a replicated loss's gradient is not multiplied by the axis size
    program = {"w": "row", "x": P(None, "model"), "b": P(), "ops": [("psum", "model"), "bias"],
               "pmean_loss": False, "tree_pmean": False}
    arrays = _arrays(2)
    mesh = _jax_mesh()

    def plain_jax(x, w, b, s):
        def loss(w):
            return s[0] * jnp.sum((jax.lax.psum(x @ w, "model") + b) ** 2)
        return jax.grad(loss)(w)[None]
    jax_false = jax.shard_map(plain_jax, mesh=mesh, in_specs=tuple(_jp(s) for s in _specs(program)),
                              out_specs=JP(EVERY), check_vma=False)(*(jnp.asarray(a.numpy()) for a in arrays))
    got, _ = cfx_run(program, arrays, False)
    torch.testing.assert_close(got[0] * 2, torch.from_numpy(np.array(jax_false)), rtol=1e-9, atol=1e-12)


# -- ZeRO's reduce-scatters and the values it returns ----------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_under_check_vma_steps_as_without_and_types_what_it_returns(stage):
    # ZeRO differentiates this rank's own copies of the params (typed as varying over data, so no
    # implicit pvary sums their gradients before it averages them): the steps equal check_vma=False's;
    # grads / grad shards vary over data, updates are typed as their params (replicated: P() passes)
    g = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g)}
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    ztx = cfx.zero(cfx.optim.sgd(0.1, momentum=0.9), stage=stage, axis="data", bucket_numel=10)

    def run(check_vma):
        seen = []

        def loss(p, x, y):
            p = cfx.zero.gather_params(p, axis="data") if stage == 3 else p
            return ((x @ p["w"] + p["b"] - y) ** 2).mean()

        def body(params, x, y):
            p = cfx.zero.shard_params(params, axis="data") if stage == 3 else params
            state = ztx.init(p)
            for _ in range(2):
                _, grads = ztx.value_and_grad(loss)(p, x, y)
                updates, state = ztx.update(grads, state, p)
                if check_vma:
                    g_leaves = grads.shards if stage == 2 else cfx.tree.leaves(grads)
                    seen.append(({frozenset(cfx.lax.varying_axes(t)) for t in g_leaves},
                                 {frozenset(cfx.lax.varying_axes(u)) for u in cfx.tree.leaves(updates)}))
                p = cfx.optim.apply_updates(p, updates)
            return p.pieces if stage == 3 else p
        with cfx.Mesh({"data": 2}) as mesh:
            out = cfx.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                out_specs=P("data") if stage == 3 else P(), check_vma=check_vma)(params, x, y)
            return cfx.device_get(out), seen
    want, _ = run(False)
    got, seen = run(True)
    cfx.tree.assert_tree_close(got, want)
    assert seen and all(g == {frozenset({"data"})} for g, _ in seen)
    # updates are typed as what they update: replicated params, or stage 3's pieces (each rank's own)
    assert all(u == ({frozenset({"data"})} if stage == 3 else {frozenset()}) for _, u in seen)


def test_zero3_pieces_vary_over_the_axis_and_gathered_params_do_not():
    params = {"w": torch.randn(6, 3), "b": torch.randn(3)}

    def body(params):
        pieces = cfx.zero.shard_params(params, axis="data")
        whole = cfx.zero.gather_params(pieces, axis="data")
        assert {cfx.lax.varying_axes(t) for t in cfx.tree.leaves(pieces.pieces)} == {frozenset({"data"})}
        assert {cfx.lax.varying_axes(t) for t in cfx.tree.leaves(whole)} == {frozenset()}
        return whole  # replicated: P() passes the check
    with cfx.Mesh({"data": 2}) as mesh:
        out = cfx.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=True)(params)
        cfx.tree.assert_close(cfx.device_get(out), params, rtol=0, atol=0)
