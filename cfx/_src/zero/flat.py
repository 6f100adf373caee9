"""Flat shard layouts: how a group of leaves is split over the ``n`` ranks of a ZeRO axis.

Every leaf is flattened and padded to a multiple of ``n``; rank ``r`` owns *piece* ``r`` of
it, ``k = ceil(numel / n)`` elements (the FSDP2 rule: every rank holds the same shapes, so a
piece has a plain ``P(axis)`` spec and a checkpoint of pieces is a padded flat per leaf). A
*group* (a ZeRO-2 bucket, a ZeRO-3 gathered layer, an optimizer group) packs its leaves' pieces
back to back into one rank-local *shard* of ``S = sum(k)`` elements, so one collective moves
the whole group:

    rows (n, S)     row r = rank r's shard = [piece_r(leaf 0), piece_r(leaf 1), ...]
    full (n * S,)   padded leaf-major: leaf i occupies [P_i, P_i + n*k_i), its numel_i first

``reduce-scatter(rows)`` sums row r over ranks into rank r's shard; ``all-gather(shard)`` gives
the n shards as the rows of one buffer, and one strided copy per leaf (``full_from_rows``) gives
``full``, whose slices are views with the leaves' shapes. The padding is at most ``n - 1``
elements per leaf.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import torch


def piece_size(numel: int, n: int) -> int:
    return -(-numel // n)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The shard layout of leaves ``paths`` (shapes ``shapes``) over ``n`` ranks (module doc)."""

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    n: int

    # derived, set once in __post_init__ (plain attributes: torch.compile reads them as constants)
    numels: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    pieces: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    offsets: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)  # piece starts in a shard
    size: int = dataclasses.field(init=False, repr=False, compare=False)     # S: elements in one shard
    numel: int = dataclasses.field(init=False, repr=False, compare=False)    # the leaves' own (no padding)

    def __post_init__(self):
        numels = tuple(math.prod(s) for s in self.shapes)
        pieces = tuple(piece_size(m, self.n) for m in numels)
        offsets = tuple(itertools.accumulate(pieces[:-1], initial=0)) if pieces else ()
        for name, value in (("numels", numels), ("pieces", pieces), ("offsets", offsets),
                            ("size", sum(pieces)), ("numel", sum(numels))):
            object.__setattr__(self, name, value)

    # -- one rank's shard ------------------------------------------------------------------------
    def shard_of(self, leaves: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard (S,) cut from full leaves (a fresh tensor)."""
        return concat_flat([piece_of(x.reshape(-1), k, rank) for x, k in zip(leaves, self.pieces)]) \
            if leaves else torch.zeros(0)

    def split_shard(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of a shard (S,), as views."""
        return list(shard.split(self.pieces)) if self.paths else []

    # -- rows <-> full leaves ----------------------------------------------------------------
    def rows_from_leaves(self, leaves: Sequence[torch.Tensor | None], *, dtype: torch.dtype) -> torch.Tensor:
        """(n, S): row r holds piece r of every leaf (None: zeros), padding zeroed."""
        rows = torch.empty(self.n, self.size, dtype=dtype, device=_device(leaves))
        for x, k, o, m in zip(leaves, self.pieces, self.offsets, self.numels):
            dst = rows[:, o:o + k]
            if x is None:
                dst.zero_()
                continue
            flat = x.detach().reshape(-1)
            q, rem = divmod(m, k) if k else (0, 0)
            if q:
                dst[:q].copy_(flat[:q * k].view(q, k))
            if rem:
                dst[q, :rem].copy_(flat[q * k:])
                dst[q, rem:].zero_()
            if q + (rem > 0) < self.n:
                dst[q + (rem > 0):].zero_()
        return rows

    def full_from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The padded leaf-major buffer (n * S,) of ``rows`` (n, S): one strided copy per leaf."""
        full = torch.empty(self.n * self.size, dtype=rows.dtype, device=rows.device)
        p = 0
        for k, o in zip(self.pieces, self.offsets):
            full[p:p + self.n * k].view(self.n, k).copy_(rows[:, o:o + k])
            p += self.n * k
        return full

    def leaves_of_full(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of a padded leaf-major buffer with the leaves' shapes."""
        out, p = [], 0
        for k, m, shape in zip(self.pieces, self.numels, self.shapes):
            out.append(full[p:p + m].view(shape))
            p += self.n * k
        return out


def concat_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened end to end (S,): a group's leaves or pieces as one flat buffer."""
    return torch.cat([x.reshape(-1) for x in tensors])


def piece_of(flat: torch.Tensor, k: int, rank: int) -> torch.Tensor:
    lo, hi = rank * k, (rank + 1) * k
    got = flat[lo:hi]
    if got.numel() == k:
        return got.clone()
    out = torch.zeros(k, dtype=flat.dtype, device=flat.device)
    out[:got.numel()] = got
    return out


def _device(leaves) -> torch.device:
    for x in leaves:
        if x is not None:
            return x.device
    return torch.device("cpu")


def make_groups(paths: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                n: int, *, max_numel: int) -> list[tuple[list[int], GroupLayout]]:
    """Consecutive leaves packed into groups of at most ``max_numel`` padded elements per rank
    times ``n`` (a leaf larger than that is a group on its own), split where the dtype changes.

    Returns ``(leaf indices, layout)`` per group, in leaf order.
    """
    groups: list[list[int]] = []
    used = 0
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        k = piece_size(math.prod(shape), n)
        if not groups or used + k * n > max_numel or dtypes[groups[-1][-1]] != dt:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += k * n
    return [(g, GroupLayout(tuple(paths[i] for i in g), tuple(tuple(shapes[i]) for i in g), n))
            for g in groups]
