"""Hypothesis strategies and checks for property-testing sharded programs.

    @given(cfx.testing.meshes(max_ranks=4), st.data())
    def test_my_layer(mesh_shape, data):
        spec = data.draw(cfx.testing.specs_for((8, 6), mesh_shape))
        with cfx.Mesh(mesh_shape) as mesh:
            cfx.testing.assert_matches_reference(per_rank_fn, reference_fn, (x,), mesh=mesh,
                                                 in_specs=(spec,), out_specs=spec)

``meshes`` draws mesh *shapes* (dicts), so the test opens and closes the Mesh itself.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from hypothesis import assume, strategies as st

from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.arrays import device_get

__all__ = ["AXIS_NAMES", "PLAN_AXES", "assert_matches_reference", "divisible_shapes", "meshes", "plans", "pytrees",
           "specs_for"]

AXIS_NAMES = ("data", "model", "pipe")
PLAN_AXES = ("pipe", "data", "seq", "model", "expert")  # a Plan's axes (``plans`` draws ``expert`` for MoE models)


@st.composite
def meshes(draw, max_ranks: int = 8, max_axes: int = 3, names: Sequence[str] = AXIS_NAMES, *,
           required: Sequence[str] = (), min_ranks: int = 1, divides: Sequence[int] = ()) -> dict[str, int]:
    """A mesh shape of 1..max_axes named axes with at most ``max_ranks`` ranks in all (and at least
    ``min_ranks``). ``required``: axes every draw has (each of 2 ranks or more); ``divides``: sizes
    (your tensors' dims) every axis size must divide, so any one-axis split of them fits."""
    unknown = [a for a in required if a not in names]
    if unknown:
        raise ValueError(f"cfx.testing.meshes: required axes {unknown} are not among names={tuple(names)}.")
    others = [a for a in names if a not in required]
    n_axes = draw(st.integers(max(1, len(required)), max(len(required), min(max_axes, len(names)))))
    chosen = list(required) + others[:n_axes - len(required)]
    shape, total = {}, 1
    for name in chosen:
        low = 2 if name in required else 1
        sizes = [n for n in range(low, 5) if total * n <= max_ranks and all(d % n == 0 for d in divides)]
        if not sizes:
            raise ValueError(f"cfx.testing.meshes: no size of axis {name!r} fits max_ranks={max_ranks} and divides "
                             f"{tuple(divides)}; raise max_ranks or drop a required axis.")
        shape[name] = draw(st.sampled_from(sizes))
        total *= shape[name]
    assume(total >= min_ranks)
    return shape


@st.composite
def specs_for(draw, shape: Sequence[int], mesh_shape: dict[str, int]) -> P:
    """A valid spec for a tensor of ``shape``: each axis used at most once, every split divisible."""
    axes = list(mesh_shape)
    draw(st.randoms(use_true_random=False)).shuffle(axes)
    entries: list[list[str]] = [[] for _ in shape]
    for a in axes:
        options = [-1] + [d for d in range(len(shape))
                          if shape[d] % (math.prod(mesh_shape[x] for x in entries[d]) * mesh_shape[a]) == 0]
        d = draw(st.sampled_from(options))
        if d >= 0:
            entries[d].append(a)
    return P(*[tuple(e) if e else None for e in entries])


@st.composite
def divisible_shapes(draw, mesh_shape: dict[str, int], ndim: int = 2, max_factor: int = 2) -> tuple[int, ...]:
    """A shape whose every dimension is divisible by the whole mesh size (any spec fits)."""
    n = math.prod(mesh_shape.values())
    return tuple(n * draw(st.integers(1, max_factor)) for _ in range(ndim))


@st.composite
def pytrees(draw, leaf_shapes: Sequence[tuple[int, ...]], *, dtype=torch.float32, max_depth: int = 2):
    """A nested dict/list pytree whose leaves are seeded random tensors of ``leaf_shapes``."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(s, generator=g, dtype=dtype) for s in leaf_shapes]

    def build(items, depth):
        if len(items) == 1 and (depth >= max_depth or draw(st.booleans())):
            return items[0]
        if draw(st.booleans()):
            return [build([x], depth + 1) for x in items]
        return {f"k{i}": build([x], depth + 1) for i, x in enumerate(items)}
    return build(leaves, 0)


@st.composite
def plans(draw, model: Any, *, max_ranks: int = 8, min_ranks: int = 2, batch: int = 8, length: int | None = None,
          axes: Sequence[str] | None = None, zero: Sequence[int] = (0, 1, 2, 3),
          remat: Sequence[str] = ("none", "blocks", "dots", "auto"), remat_budget: str = "64MiB",
          offload: Sequence[str] = ("none", "host", "auto"), offload_budget: str = "64MiB", params: Any = None,
          init: Any = None, specs: Any = None):
    """A ``cfx.parallel.Plan`` that can train ``model`` on a batch of ``batch`` rows: a mesh over
    ``axes`` (a random subset, in a random order; by default ``PLAN_AXES``: ``pipe`` / ``data`` /
    ``seq`` / ``model``, and ``expert`` for a model with mixture-of-experts blocks) of at most
    ``max_ranks`` ranks, the sequence parallelism (``ring`` or ``ulysses`` with a seq axis; with
    a model axis alone, Megatron-SP or none), a ZeRO stage (only with a data axis), with ZeRO-3
    an offload (``auto`` places chunks within ``offload_budget`` device bytes), a remat mode
    (``auto`` solves for ``remat_budget``) and, with a pipe axis, a schedule and microbatches.
    Draws that the model or sequences of ``length`` rule out (heads not divisible, ...) are
    rejected, and so are meshes of fewer than ``min_ranks`` ranks (one rank shards nothing).

        @given(cfx.testing.plans(my_model))
        def test_my_model_trains_the_same_sharded(plan): ...

    ``model`` may be your own loss function with its ``params=`` (or ``init=``) and ``specs=``, as
    ``Plan.step`` takes it: then the draws are the axes such a function can take -- ``data`` (with
    ZeRO and offload), and ``model`` where ``specs`` name it -- with remat ``none`` / ``blocks`` /
    ``dots`` (``auto`` schedules a chain of blocks a function does not have).
    """
    from cfx._src.models.function import as_model
    from cfx._src.parallel.expert import has_experts
    from cfx._src.plan.config import SCHEDULES
    from cfx._src.plan.plan import Plan
    function = {k: v for k, v in dict(params=params, init=init, specs=specs).items() if v is not None}
    own = as_model(model, **function) is not model  # a loss function (a ValueError without params= / init=)
    if own:
        axes = axes or (("data", "model") if specs is not None else ("data",))
        remat = [r for r in remat if r != "auto"]
    if axes is None:
        axes = tuple(a for a in PLAN_AXES if a != "expert" or has_experts(model))
    unknown = [a for a in axes if a not in PLAN_AXES]
    if unknown or not axes:
        raise ValueError(f"cfx.testing.plans: axes={tuple(axes)} must be a non-empty subset of PLAN_AXES={PLAN_AXES}.")
    axes = draw(st.permutations(tuple(axes)))[:draw(st.integers(1, len(axes)))]
    mesh, total = [], 1
    for a in axes:
        size = draw(st.sampled_from([s for s in (1, 2, 4) if total * s <= max_ranks]))
        mesh.append((a, size))
        total *= size
    shape = dict(mesh)
    assume(total >= min_ranks)
    fields: dict[str, Any] = dict(mesh=tuple(mesh), remat=draw(st.sampled_from(list(remat))))
    if fields["remat"] == "auto":
        fields["remat_budget"] = remat_budget
    if "seq" in shape:
        fields["sp"] = draw(st.sampled_from(["ring", "ulysses"]))
    elif "model" in shape and not own:  # (a loss function has no token sequence to split)
        fields["sp"] = draw(st.sampled_from(["none", "megatron"]))
    if "data" in shape:
        fields["zero"] = draw(st.sampled_from(list(zero)))
        if fields["zero"] == 3:
            fields["offload"] = draw(st.sampled_from(list(offload)))
            if fields["offload"] == "auto":
                fields["offload_budget"] = offload_budget
    rows = shape.get("data", 1) * shape.get("expert", 1)  # the axes the batch's rows split over
    if "pipe" in shape:
        per_rank = batch // rows
        fields["schedule"] = draw(st.sampled_from(SCHEDULES))
        fields["microbatches"] = draw(st.sampled_from([m for m in (1, 2, 4) if per_rank % m == 0] or [1]))
    assume(batch % rows == 0)
    plan = Plan(**fields)
    try:
        plan.check(model, **function)
        plan.check_batch(batch, length)
    except ValueError:
        assume(False)
    return plan


def assert_matches_reference(per_rank_fn: Callable[..., Any], reference_fn: Callable[..., Any],
                             args: tuple, *, mesh, in_specs: Any, out_specs: Any,
                             rtol: float | None = None, atol: float | None = None) -> None:
    """``shard_map(per_rank_fn)(*args)`` equals ``reference_fn(*args)`` leaf by leaf.

    To check gradients, have both functions return them (e.g. ``cfx.grad`` inside the per-rank
    body with the collectives' transposes, ``cfx.grad`` of the single-device loss outside).
    """
    sharded = device_get(shard_map(per_rank_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args))
    expected = reference_fn(*args)
    tree_util.assert_close(sharded, expected, rtol=rtol, atol=atol)


def __dir__() -> list[str]:  # dir(cfx.testing): its strategies, not its imports
    return list(__all__)
