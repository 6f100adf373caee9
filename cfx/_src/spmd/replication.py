"""Replication checks at ``shard_map`` outputs (``check_rep``).

An out_spec that leaves a mesh axis out says the output is the same on every rank along it; the
call keeps one replica, so a value that differs there would silently come back as one rank's.
``shard_map`` checks it by default, two ways:

* *types*, where the body tracks varying axes (it is differentiated from outside, or
  ``check_vma=True``): an output whose type varies over a left-out axis is refused at once, as
  JAX does. The types prove variation, not its absence (variation that comes from Python, an
  ``axis_index`` turned into a tensor, is not seen), so
* *values* are compared too: each output leaf's replicas at up to ``SAMPLE`` evenly spaced
  elements (``check_rep=True``), or at every element (``check_rep="full"``), bit for bit (NaN
  equals NaN, -0.0 equals 0.0). On the local backend this process holds every replica and
  compares them in place, no collective; under ``dist`` each process sends digests of its
  samples in one small all-gather over the mesh (and, only where one differs, the samples
  themselves, to name the leaf), and every rank reaches the same verdict.

Python numbers, strings and None that a body returns are compared as values; other objects (an
engine returned for inspection) are per-rank by nature and come back as rank 0's, unchecked.

A sample catches what goes wrong in practice -- a loss, a gradient or a batch statistic that was
never reduced differs at (nearly) every element; ``"full"`` is for a value that differs in a few
elements only. ``check_rep=False`` skips both.
"""
from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P

SAMPLE = 64  # elements of each output leaf compared across its replicas by default
MODES = (True, False, "full")
_VALUES = (bool, int, float, complex, str, type(None))  # Python outputs compared; other objects (an
# engine returned for inspection) are per-rank by nature and come back as rank 0's unchecked


def check_mode(check_rep: Any) -> bool | str:
    if check_rep not in MODES or isinstance(check_rep, int) and not isinstance(check_rep, bool):
        raise ValueError(f"shard_map: check_rep must be True (compare a sample of each replicated output), "
                         f"'full' (every element) or False (no check), got {check_rep!r}.")
    return check_rep


def left_out(spec: P, mesh) -> tuple[str, ...]:
    """The axes (of more than one rank) ``spec`` leaves out: the output is replicated over them."""
    used = set(spec.all_axes())
    return tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)


def error(path: str, spec: P, mesh, axes, why: str) -> ValueError:
    axes = list(axes)
    names = " and ".join(repr(a) for a in axes)
    example = P(axes[0] if len(axes) == 1 else tuple(axes))
    return ValueError(
        f"shard_map: output {path or '<root>'!r} varies over mesh axis {names} of {mesh!r} ({why}), but its "
        f"out_spec {spec!r} leaves {names} out, which says it is the same on every rank there. Two programs "
        f"end here. A value computed from one split over {names} that was never summed: reduce it in the body "
        f"(cfx.lax.psum / pmean over {names}). Or the gradient of a param the same on every rank (an embedding, a "
        f"norm) that met a value split over {names}: its gradient needs summing over {names} -- "
        f"shard_map(..., check_vma=True) does that by JAX's implicit pvary, or wrap the param in "
        f"cfx.lax.pvary(x, {axes[0]!r}) where it meets the split. If the output really differs per rank, name "
        f"the axis in its out_spec (e.g. {example!r} for its first dimension). (check_rep=False only skips "
        "this check: one rank's value comes back.)")


# -- types ---------------------------------------------------------------------------------------
def check_types(items: list[tuple[str, Any, P]], mesh, varying_axes) -> None:
    """ValueError for the first output whose varying-axes type names a left-out axis."""
    for path, x, spec in items:
        if isinstance(x, torch.Tensor):
            bad = [a for a in left_out(spec, mesh) if a in varying_axes(x)]
            if bad:
                raise error(path, spec, mesh, bad, "its type, cfx.lax.varying_axes, says so")


# -- values --------------------------------------------------------------------------------------
def _sample(x: torch.Tensor, k: int | None) -> torch.Tensor:
    """Up to ``k`` evenly spaced elements of ``x`` (a view where ``x`` is contiguous); all of it
    for ``k=None``."""
    n = x.numel()
    if k is None or n <= k:
        return x
    if x.is_contiguous():
        return x.view(-1)[::n // k][:k]
    return torch.take(x, _positions(n, k, x.device))


@functools.lru_cache(maxsize=256)
def _positions(n: int, k: int, device) -> torch.Tensor:
    return torch.arange(k, device=device) * (n // k)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """``x`` as int64 bits in which equal values are equal (one NaN, 0.0 for -0.0)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():
        x = x.to(torch.float64)
        return torch.where(x.isnan(), torch.full_like(x, float("nan")), x + 0.0).view(torch.int64)
    return x.to(torch.int64)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a, b) or ((a.is_floating_point() or a.is_complex())
                                     and torch.equal(_canonical(a), _canonical(b)))
    return a == b


def _varying(values: dict[int, Any], axes: tuple[str, ...], mesh) -> tuple[list[str], int, int]:
    """Of ``axes``, those along which two ranks' values differ, and one such pair of ranks."""
    out, pair = [], None
    for a in axes:
        for r, v in values.items():
            c = mesh.coords(r)
            if c[a]:
                q = mesh.rank_of(dict(c, **{a: 0}))
                if q in values and not _same(v, values[q]):
                    out.append(a)
                    pair = pair or (q, r)
                    break
    return out, *(pair or (None, None))


def _why(mesh, q: int, r: int, full: bool) -> str:
    return (f"rank {r} {mesh.coords(r)} differs from rank {q} {mesh.coords(q)}"
            f"{'' if full else f' in a sample of {SAMPLE} elements'}")


def check_values(items: list[tuple[str, Any, P]], blocks: list[dict[int, Any]], mesh, mode) -> None:
    """Local backend: every rank's output ``blocks[i][rank]`` of leaf ``items[i]`` is here."""
    k = None if mode == "full" else SAMPLE
    for (path, leaf, spec), per_rank in zip(items, blocks):
        axes = left_out(spec, mesh)
        if not axes or not isinstance(leaf, (torch.Tensor, *_VALUES)):
            continue
        samples = {r: _sample(b, k) if isinstance(b, torch.Tensor) else b for r, b in per_rank.items()}
        primary = {r: mesh.rank_of(dict(mesh.coords(r), **{a: 0 for a in axes})) for r in samples}
        if all(_same(v, samples[primary[r]]) for r, v in samples.items()):
            continue
        bad, q, r = _varying(samples, axes, mesh)
        if not bad:  # differs from its primary only along two axes at once: name both
            bad, r = list(axes), next(r for r, v in samples.items() if not _same(v, samples[primary[r]]))
            q = primary[r]
        raise error(path, spec, mesh, bad, _why(mesh, q, r, k is None))


SLOTS = 64  # digest slots per rank in the one all-gather of the dist check
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so no single-element change cancels


def check_values_dist(items: list[tuple[str, Any, P]], mesh, mode, all_gather) -> None:
    """Under ``dist``, inside this process's rank; ``all_gather(x, axes)``: ``(n,) -> (N, n)``
    over every mesh axis, rows in rank order.

    One all-gather of a fixed size per call: a header (how many leaves, how many sampled
    elements, a checksum of paths, shapes and dtypes -- a rank that returned another structure
    is named before anything of its size is exchanged) and ``SLOTS`` digests, each the
    position-weighted sum of the sampled bits of some leaves that share one set of left-out
    axes. Where a digest differs across a replica set, every rank sees it in the same gathered
    rows, and all exchange the samples themselves to name the leaf, the axes and two ranks."""
    k = None if mode == "full" else SAMPLE
    checked = [(path, x, spec) for path, x, spec in items
               if left_out(spec, mesh) and isinstance(x, (torch.Tensor, *_VALUES))]
    if not checked:  # nothing replicated: no exchange
        return
    values = [x.detach() if isinstance(x, torch.Tensor) else torch.tensor(
        [x] if isinstance(x, (bool, int, float, complex)) else [zlib.crc32(repr(x).encode())]) for _, x, _ in checked]
    # one concatenation and one conversion per dtype, not per leaf (a step returns many leaves)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(values):
        by_dtype.setdefault(x.dtype, []).append(i)
    parts, order, sizes = [], [], []
    for idx in by_dtype.values():
        samples = [_sample(values[i], k).reshape(-1) for i in idx]
        parts.append(_canonical(torch.cat(samples)))
        order += idx
        sizes += [x.numel() for x in samples]
    flat = torch.cat(parts)  # leaves in `order`
    # digests: the leaves of each set of left-out axes spread over their share of the slots
    groups: dict[tuple[str, ...], list[int]] = {}
    for j, i in enumerate(order):
        groups.setdefault(left_out(checked[i][2], mesh), []).append(j)
    share = max(1, SLOTS // len(groups))
    slot_of, slots_of = [0] * len(order), {}
    for g, (axes, js) in enumerate(groups.items()):
        for n, j in enumerate(js):
            slot_of[j] = (g * share + n % share) % SLOTS
        slots_of[axes] = sorted({slot_of[j] for j in js})
    where = torch.repeat_interleave(torch.tensor(slot_of), torch.tensor(sizes), output_size=flat.numel())
    weights = torch.arange(flat.numel(), dtype=torch.int64).mul_(_MIX).bitwise_or_(1)
    digest = torch.zeros(SLOTS, dtype=torch.int64).index_add_(0, where, flat * weights)
    layout = repr([(p, tuple(x.shape), x.dtype) for (p, _, _), x in zip(checked, values)])
    header = torch.tensor([len(checked), flat.numel(), zlib.crc32(layout.encode())], dtype=torch.int64)
    names = tuple(mesh.axis_names)
    rows = all_gather(torch.cat([header, digest]), names)  # (N, 3 + SLOTS)
    heads = rows[:, :3]
    if not (heads == heads[0]).all():
        r = int((heads != heads[0]).any(1).nonzero()[0])
        raise ValueError(f"shard_map: rank {r} {mesh.coords(r)} of {mesh!r} returned outputs of another "
                         "structure, shape or dtype than rank 0; every rank must return blocks of one "
                         "shape and dtype per output.")
    suspects = []
    for axes, js in groups.items():
        primary = [mesh.rank_of(dict(mesh.coords(r), **{a: 0 for a in axes})) for r in range(mesh.size)]
        cols = rows[:, [3 + s for s in slots_of[axes]]]
        if not torch.equal(cols, cols[primary]):
            suspects.append((axes, js))
    if not suspects:
        return
    segments = all_gather(flat, names).split(sizes, dim=1)  # every rank: the same suspects
    for axes, js in suspects:
        for j in js:
            bad, q, r = _varying({r: segments[j][r] for r in range(mesh.size)}, axes, mesh)
            if bad:
                path, _, spec = checked[order[j]]
                raise error(path, spec, mesh, bad, _why(mesh, q, r, k is None))


def out_items(out_specs: Any, flat: list, treedef, mesh) -> list[tuple[str, Any, P]]:
    from cfx._src.spmd.spec_tree import broadcast_specs
    return broadcast_specs(out_specs, tree_util.unflatten(treedef, flat), "out_specs", mesh)
