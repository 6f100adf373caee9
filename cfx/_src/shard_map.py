"""``shard_map``: run a function once per rank on local blocks, with JAX's semantics.

``in_specs`` / ``out_specs`` are pytree prefixes of the arguments / outputs whose leaves are
``P`` specs. Each rank's block of a global input is its slice along every split dimension; an
output dimension split over axes is concatenated from the ranks in axis order, and a mesh axis
absent from an output's spec asserts the output is replicated along it (``check_rep=True``
verifies that). All validation happens before any rank starts, so a bad spec is a ValueError
naming the leaf path and the mesh, never a hang.

Inside ``f``, differentiate with ``cfx.grad`` (each rank's backward issues the collectives'
transposes); gradients do not flow from the caller through ``shard_map`` itself.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

from cfx._src import tree as tree_util
from cfx._src.mesh.spec import P, is_spec


def _broadcast_specs(specs: Any, tree: Any, what: str, mesh) -> list[tuple[str, Any, P]]:
    """``(path, leaf, spec)`` for every leaf of ``tree`` with the spec its prefix assigns."""
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec, namespace=tree_util.NAMESPACE)
    except ValueError as e:
        raise ValueError(f"shard_map: {what} do not match the structure of the {what.split()[0]} "
                         f"values on {mesh!r}: {e}. Give one P per leaf, or a P for a whole "
                         "subtree (a pytree prefix).") from None
    items, _ = tree_util.flatten_with_path(tree)
    spec_leaves = tree_util.leaves(full, is_leaf=is_spec)
    out = []
    for (path, leaf), spec in zip(items, spec_leaves):
        if what == "in_specs":  # "0.wte.w" -> "args[0].wte.w"
            head, _, rest = path.partition(".")
            path = f"args[{head}]" + (f".{rest}" if rest else "")
        if not is_spec(spec):
            raise ValueError(f"shard_map: {what} leaf {path or '<root>'!r} must be a cfx.P spec, got "
                             f"{spec!r}.")
        out.append((path, leaf, spec))
    return out


def check_spec(path: str, shape: tuple[int, ...], spec: P, mesh, where: str, *, block: bool = False) -> None:
    """ValueError naming the path, the mesh and the fix unless ``spec`` can split ``shape``."""
    label = f"{where}: leaf {path or '<root>'!r} with shape {tuple(shape)} and spec {spec!r} on {mesh!r}"
    if len(spec) > len(shape):
        raise ValueError(f"{label}: the spec has {len(spec)} entries but the leaf only {len(shape)} "
                         "dimensions; drop the extra entries.")
    used: list[str] = []
    for dim in range(len(spec)):
        axes = spec.axes_of(dim)
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(f"{label}: unknown mesh axis {a!r}; the mesh has axes "
                                 f"{list(mesh.axis_names)}. Fix the spec or the mesh.")
        used.extend(axes)
        n = mesh.axes_size(axes)
        if not block and shape[dim] % n:
            raise ValueError(f"{label}: dimension {dim} has size {shape[dim]}, not divisible by {n} "
                             f"(the size of {'x'.join(axes)}). Pad the dimension or split it over "
                             "other axes.")
    dup = sorted({a for a in used if used.count(a) > 1})
    if dup:
        raise ValueError(f"{label}: mesh axis {dup[0]!r} is used twice in one spec; each axis may "
                         "split at most one dimension.")


def block_of(x: torch.Tensor, spec: P, mesh, coords: dict) -> torch.Tensor:
    """The slice of global ``x`` that the rank at ``coords`` holds under ``spec``."""
    for dim in range(len(spec)):
        axes = spec.axes_of(dim)
        if axes:
            n = mesh.axes_size(axes)
            size = x.shape[dim] // n
            x = x.narrow(dim, mesh.index_in(axes, coords) * size, size)
    return x


def assemble(blocks: list[Any], spec: P, mesh, path: str, *, check_rep: bool) -> Any:
    """The global value from every rank's block (``blocks[rank]``) under ``spec``."""
    first = blocks[0]
    spec_axes = set(spec.all_axes())
    if not isinstance(first, torch.Tensor):
        if check_rep and any(b != first for b in blocks):
            raise ValueError(f"shard_map: output {path or '<root>'!r} differs across ranks but its "
                             f"out_spec {spec!r} says it is replicated on {mesh!r}.")
        return first
    check_spec(path, tuple(first.shape), spec, mesh, "shard_map out_specs", block=True)
    shape = list(first.shape)
    for dim in range(len(spec)):
        shape[dim] *= mesh.axes_size(spec.axes_of(dim))
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for rank, b in enumerate(blocks):
            coords = mesh.coords(rank)
            if any(coords[a] for a in mesh.axis_names if a not in spec_axes):
                if check_rep:
                    rep = dict(coords, **{a: 0 for a in mesh.axis_names if a not in spec_axes})
                    if not torch.equal(b, blocks[mesh.rank_of(rep)]):
                        raise ValueError(
                            f"shard_map: output {path or '<root>'!r} differs between rank {rank} "
                            f"{coords} and its replica on {mesh!r}, but out_spec {spec!r} leaves "
                            f"axes {[a for a in mesh.axis_names if a not in spec_axes]} out (= "
                            "replicated). Reduce it (psum/pmean) or name the axis in the spec.")
                continue
            block_of(out, spec, mesh, coords).copy_(b)
    return out


def shard_map(f: Callable[..., Any], *, mesh, in_specs: Any, out_specs: Any,
              check_rep: bool = False) -> Callable[..., Any]:
    """``f`` run per rank of ``mesh`` on blocks of its arguments; see the module docstring."""

    @functools.wraps(f)
    def wrapped(*args):
        specs = in_specs if isinstance(in_specs, tuple) and not is_spec(in_specs) else (in_specs,)
        if len(specs) != len(args):
            raise ValueError(f"shard_map: got {len(args)} arguments but {len(specs)} in_specs on "
                             f"{mesh!r}; give one spec (or spec pytree) per positional argument.")
        items = _broadcast_specs(tuple(specs), tuple(args), "in_specs", mesh)
        for path, leaf, spec in items:
            if isinstance(leaf, torch.Tensor):
                check_spec(path, tuple(leaf.shape), spec, mesh, "shard_map in_specs")
            elif len(spec):
                raise ValueError(f"shard_map: in_specs leaf {path!r} is a {type(leaf).__name__}, which "
                                 "cannot be split; give it P().")
        _, treedef = tree_util.flatten(tuple(args))

        def on_rank(rank: int):
            coords = mesh.coords(rank)
            leaves = [block_of(x.detach(), spec, mesh, coords).clone() if isinstance(x, torch.Tensor) else x
                      for _, x, spec in items]
            return f(*tree_util.unflatten(treedef, leaves))

        outs = mesh.run(on_rank)
        ref = tree_util.structure(outs[0])
        for rank, o in enumerate(outs[1:], start=1):
            if tree_util.structure(o) != ref:
                raise ValueError(f"shard_map: rank {rank} returned a different pytree structure than "
                                 f"rank 0 on {mesh!r}; every rank must return the same structure.")
        per_rank = [tree_util.leaves(o) for o in outs]
        out_items = _broadcast_specs(out_specs, outs[0], "out_specs", mesh)
        assembled = [assemble([pr[i] for pr in per_rank], spec, mesh, path, check_rep=check_rep)
                     for i, (path, _, spec) in enumerate(out_items)]
        return tree_util.unflatten(ref, assembled)

    return wrapped
