"""cfx.lax collectives against JAX's list-of-blocks semantics, values and gradients."""
import itertools

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P

pytestmark = pytest.mark.timeout(120)

AXES = ("a", "b", "c")


@st.composite
def mesh_and_axes(draw, max_ranks=8):
    """A mesh shape of 1-3 axes with at most ``max_ranks`` ranks, and a non-empty ordered subset."""
    n_axes = draw(st.integers(1, 3))
    sizes = []
    for _ in range(n_axes):
        room = max_ranks // max(1, (sizes and __import__("math").prod(sizes)) or 1)
        sizes.append(draw(st.integers(1, max(1, min(4, room)))))
    shape = dict(zip(AXES, sizes))
    chosen = draw(st.lists(st.sampled_from(list(shape)), min_size=1, max_size=n_axes, unique=True))
    return shape, tuple(chosen)


def groups(shape, axes):
    """Ranks grouped by their coordinates outside ``axes``; each group ordered by ``axes`` index."""
    names = list(shape)
    ranks = list(itertools.product(*[range(shape[n]) for n in names]))
    out = {}
    for r, c in enumerate(ranks):
        coords = dict(zip(names, c))
        key = tuple(coords[n] for n in names if n not in axes)
        idx = 0
        for a in axes:
            idx = idx * shape[a] + coords[a]
        out.setdefault(key, {})[idx] = r
    return [[g[i] for i in sorted(g)] for g in out.values()]


def run(shape, fn, blocks):
    """``fn(block, rank)`` on every rank; returns the per-rank outputs (a list of tuples of tensors)."""
    n = len(blocks)
    x = torch.stack(blocks)  # (N, ...) one block per rank, in rank order
    with cfx.Mesh(shape, timeout=30) as mesh:
        all_axes = tuple(mesh.axis_names)

        def body(xb):
            rank = mesh.rank_of({a: cfx.lax.axis_index(a) for a in all_axes})
            outs = fn(xb[0], rank)
            return tuple(o[None] for o in outs)
        outs = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(all_axes), out_specs=P(all_axes))(x))
    return [tuple(o[r] for o in outs) for r in range(n)]


def rand_blocks(n, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]


def check(shape, axes, coll, reference, block_shape, *, invariant, seed=0, invariant_input=False):
    """Values and gradients of ``coll`` vs ``reference(list_of_group_blocks) -> list of outputs``.

    ``invariant``: the output is replicated over the group (one cotangent per group).
    ``invariant_input``: the input is replicated over the group (one logical input per group,
    whose gradient sums every member's contribution).
    """
    n = __import__("math").prod(shape.values())
    xs = rand_blocks(n, block_shape, seed)
    gs = groups(shape, axes)
    ref_out = [None] * n
    xs_ref = [x.clone().requires_grad_() for x in xs]
    for grp in gs:
        if invariant_input:
            for r in grp:
                xs[r], xs_ref[r] = xs[grp[0]], xs_ref[grp[0]]
        outs = reference([xs_ref[r] for r in grp])
        for r, o in zip(grp, outs):
            ref_out[r] = o
    ws = rand_blocks(n, ref_out[0].shape, seed + 1)
    if invariant:  # a replicated result has one cotangent, the same on every rank of its group
        for grp in gs:
            for r in grp:
                ws[r] = ws[grp[0]]
        total = sum((ref_out[grp[0]] * ws[grp[0]]).sum() for grp in gs)
    else:
        total = sum((o * w).sum() for o, w in zip(ref_out, ws))
    firsts = [xs_ref[grp[0]] for grp in gs] if invariant_input else xs_ref
    grads = torch.autograd.grad(total, firsts, allow_unused=True) if total.requires_grad else [None] * len(firsts)
    ref_grads = {id(x): torch.zeros_like(x) if g is None else g for x, g in zip(firsts, grads)}
    ref_grads = [ref_grads[id(x)] for x in xs_ref]

    def fn(xb, rank):
        xb = xb.requires_grad_()
        out = coll(xb)
        (g,) = torch.autograd.grad((out * ws[rank]).sum(), xb)
        return out.detach(), g

    got = run(shape, fn, xs)
    for r in range(n):
        torch.testing.assert_close(got[r][0], ref_out[r].detach(), msg=lambda m: f"value, rank {r}: {m}")
        torch.testing.assert_close(got[r][1], ref_grads[r], msg=lambda m: f"grad, rank {r}: {m}")


@given(mesh_and_axes(), st.integers(0, 100))
def test_psum_pmean(ma, seed):
    shape, axes = ma
    check(shape, axes, lambda x: cfx.lax.psum(x, axes), lambda bs: [sum(bs)] * len(bs), (3, 2),
          invariant=True, seed=seed)
    check(shape, axes, lambda x: cfx.lax.pmean(x, axes), lambda bs: [sum(bs) / len(bs)] * len(bs), (2,),
          invariant=True, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100), st.sampled_from(["max", "min"]))
def test_pmax_pmin(ma, seed, which):
    shape, axes = ma
    coll = cfx.lax.pmax if which == "max" else cfx.lax.pmin
    red = torch.amax if which == "max" else torch.amin
    check(shape, axes, lambda x: coll(x, axes), lambda bs: [red(torch.stack(bs), 0)] * len(bs), (4,),
          invariant=True, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100))
def test_pvary_transposes_to_psum(ma, seed):
    shape, axes = ma
    check(shape, axes, lambda x: cfx.lax.pvary(x, axes) * 2, lambda bs: [b * 2 for b in bs], (3,),
          invariant=False, invariant_input=True, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100), st.booleans(), st.integers(0, 1))
def test_all_gather(ma, seed, tiled, dim):
    shape, axes = ma
    join = (lambda bs: torch.cat(bs, dim)) if tiled else (lambda bs: torch.stack(bs, dim))
    check(shape, axes, lambda x: cfx.lax.all_gather(x, axes, dim=dim, tiled=tiled),
          lambda bs: [join(bs)] * len(bs), (2, 3), invariant=False, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100), st.booleans())
def test_psum_scatter(ma, seed, tiled):
    shape, axes = ma
    n = __import__("math").prod(shape[a] for a in axes)

    def ref(bs):
        total = sum(bs)
        return list(total.chunk(n, 1)) if tiled else list(total.unbind(1))
    check(shape, axes, lambda x: cfx.lax.psum_scatter(x, axes, dim=1, tiled=tiled), ref,
          (2, n * (2 if tiled else 1)), invariant=False, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100))
def test_all_to_all(ma, seed):
    shape, axes = ma
    n = __import__("math").prod(shape[a] for a in axes)

    def ref(bs):  # rank i receives block i of every sender's split dim, concatenated by sender
        return [torch.cat([b.chunk(n, 0)[i] for b in bs], 1) for i in range(n)]
    check(shape, axes, lambda x: cfx.lax.all_to_all(x, axes, split_dim=0, concat_dim=1), ref,
          (2 * n, 3), invariant=False, seed=seed)


@given(mesh_and_axes(), st.integers(0, 100), st.randoms(use_true_random=False))
def test_ppermute(ma, seed, rnd):
    shape, axes = ma
    n = __import__("math").prod(shape[a] for a in axes)
    dsts = list(range(n))
    rnd.shuffle(dsts)
    perm = [(s, d) for s, d in zip(range(n), dsts)][: rnd.randint(0, n)]

    def ref(bs):
        out = [torch.zeros_like(b) for b in bs]
        for s, d in perm:
            out[d] = bs[s] * 1
        return out
    check(shape, axes, lambda x: cfx.lax.ppermute(x, axes, perm), ref, (3,), invariant=False, seed=seed)


def test_axis_index_and_size_follow_requested_order():
    with cfx.Mesh({"a": 2, "b": 3}) as mesh:
        f = cfx.shard_map(lambda x: torch.tensor([[cfx.lax.axis_index(("b", "a")), cfx.lax.axis_size(("b", "a")),
                                                   cfx.lax.axis_index("a"), cfx.lax.axis_index("b")]]),
                          mesh=mesh, in_specs=P(), out_specs=P(("a", "b")))
        out = cfx.device_get(f(torch.zeros(1)))
    for rank, (ba, size, a, b) in enumerate(out.tolist()):
        assert (a, b) == divmod(rank, 3) and size == 6 and ba == b * 2 + a


def test_bad_collective_arguments_raise_value_errors():
    with cfx.Mesh({"a": 2}) as mesh:
        for body, match in [
            (lambda x: cfx.lax.psum(x, "nope"), "unknown mesh axis 'nope'"),
            (lambda x: cfx.lax.psum_scatter(x, "a", dim=0, tiled=True), "not divisible"),
            (lambda x: cfx.lax.ppermute(x, "a", [(0, 1), (1, 1)]), "unique"),
        ]:
            with pytest.raises(ValueError, match=match):
                cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(torch.zeros(3)))
    with pytest.raises(ValueError, match="inside cfx.shard_map"):
        cfx.lax.psum(torch.zeros(1), "a")
