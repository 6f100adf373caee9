"""Model coordinates: where each tensor of a Plan's state sits in the single-device state.

A plan keeps its state in its own layout (``layout``): tensor-parallel blocks, a pipe axis's
stacked rows, ZeRO's flat pieces, per-rank optimizer state. In *model coordinates* the state is
what one device would hold: the model's params tree and ``tx.init(params)`` of the optimizer
the plan was given, whole leaves. Every tensor a rank holds is a ``Region`` of one such leaf:

- a rectangle, the rank's tensor-parallel block of the leaf (a pipe stage's row of a stacked
  leaf is the block of ``blocks.<i>`` for the model block ``i`` that row runs);
- or a flat range of that rectangle (row-major), for a ZeRO piece: rank ``d`` of ``n`` on the
  data axis holds elements ``[d k, (d + 1) k)`` of the flattened block, ``k = ceil(numel / n)``,
  the padding past ``numel`` being no element of the model's state.

An optimizer state leaf is matched to the params leaf it mirrors by its path's suffix and its
shape (what ``cfx.zero``'s ``state_specs`` does); any other leaf (a step count, a loss scale) is
the whole leaf, the same on every rank. A checkpoint written in these coordinates (``Program.save``)
loads onto any plan of the same model and optimizer -- another mesh, ZeRO stage or pipe axis,
or whole tensors on one device.

``flat_boxes`` cuts a flat range of a rectangle into the rectangles it is made of (at most
``2 ndim - 1``, each contiguous in the flat order), so a checkpoint stores and reads rectangles only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh.layout import block_shape
from cfx._src.mesh.spec import is_spec
from cfx._src.zero.flat import piece_size
from cfx._src.zero.optimizer import ZeroState
from cfx._src.zero.params import ZeroParams


@dataclasses.dataclass(frozen=True)
class Region:
    """Elements of the model-coordinate leaf ``path``: the rectangle ``[lo, lo + size)``, or with
    ``flat`` only the range ``[start, stop)`` of that rectangle's row-major order."""

    path: str
    lo: tuple[int, ...]
    size: tuple[int, ...]
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.size) if self.flat is None else self.flat[1] - self.flat[0]

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``[(global offsets, shape, start)]``: the rectangles this region is made of, in order,
        each the elements ``[start, start + numel)`` of the region's flat tensor."""
        if self.flat is None:
            return [(self.lo, self.size, 0)]
        a = self.flat[0]
        return [(tuple(l + o for l, o in zip(self.lo, off)), shape, s - a)
                for off, shape, s in flat_boxes(self.size, *self.flat)]


def flat_boxes(size: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[start, stop)`` of a row-major ``size`` rectangle as rectangles
    ``(offsets, shape, flat start)``, in flat order, each contiguous in that order."""
    if start >= stop:
        return []
    if not size:
        return [((), (), 0)]
    row = math.prod(size[1:])
    (i0, r0), (i1, r1) = divmod(start, row), divmod(stop, row)
    rest = tuple(size[1:])

    def within(i: int, a: int, b: int) -> list:  # part of row i
        return [((i, *o), (1, *s), i * row + f) for o, s, f in flat_boxes(rest, a, b)]

    if i0 == i1:
        return within(i0, r0, r1)
    out = []
    if r0:
        out += within(i0, r0, row)
        i0 += 1
    if i1 > i0:
        out.append(((i0,) + (0,) * len(rest), (i1 - i0, *rest), i0 * row))
    if r1:
        out += within(i1, 0, r1)
    return out


class ModelCoords:
    """Where each tensor a rank of ``layout``'s plan holds sits in model coordinates (module doc).
    ``clipped``: the plan chained a clip (stateless) in front of the optimizer it was given."""

    def __init__(self, layout, mesh, *, zero: int, clipped: bool):
        self.layout, self.mesh, self.zero, self.clipped = layout, mesh, zero, clipped
        items, _ = tree_util.flatten_with_path(layout.model_shapes)
        specs = tree_util.leaves(layout.model_specs, is_leaf=is_spec)
        self.leaves = {p: (tuple(x.shape), s) for (p, x), s in zip(items, specs)}

    # -- one rank ----------------------------------------------------------------------------------
    def entries(self, rank: int, params: Any, opt_state: Any) -> Iterator[tuple[Region, torch.Tensor]]:
        """``(region, tensor)`` for every tensor rank ``rank`` holds, given its blocks of the stored
        params and optimizer state (trees of tensors; meta tensors give the regions alone). Each
        tensor is a view of those blocks with the region's shape (flat: 1-D)."""
        coords = self.mesh.coords(rank)
        view = self.layout.local_view(params)
        leaves = tree_util.flatten_with_path(view.pieces if isinstance(view, ZeroParams) else view)[0]
        mirrored = {}  # view leaf path -> (its region, its tensor's shape)
        for path, x in leaves:
            region, t = self._param(path, x, coords)
            mirrored[path] = (region, tuple(x.shape))
            if region.numel:
                yield dataclasses.replace(region, path=f"params.{region.path}"), t
        yield from self._state(opt_state, mirrored, coords)

    def _param(self, path: str, x: torch.Tensor, coords: dict) -> tuple[Region, torch.Tensor]:
        name = self._model_path(path, coords)
        shape, spec = self.leaves[name]
        size = block_shape(shape, spec, self.mesh)
        lo = tuple(self.mesh.index_in(spec.axes_of(d), coords) * n if spec.axes_of(d) else 0
                   for d, n in enumerate(size))
        if self.layout.zero3:  # the view holds the data rank's piece of the block
            return self._piece(Region(name, lo, size), x, coords)
        return Region(name, lo, size), x

    def _piece(self, whole: Region, x: torch.Tensor, coords: dict) -> tuple[Region, torch.Tensor]:
        """The data rank's flat piece ``x`` of the rectangle ``whole`` (its padding cut off)."""
        numel, k = math.prod(whole.size), x.numel()
        a = min(coords.get("data", 0) * k, numel)
        b = min(a + k, numel)
        return dataclasses.replace(whole, flat=(a, b)), x[:b - a]

    def _state(self, opt_state: Any, mirrored: dict, coords: dict) -> Iterator[tuple[Region, torch.Tensor]]:
        inner = opt_state
        if isinstance(opt_state, ZeroState):
            if any(m is not None for m in opt_state.master):
                raise ValueError("cfx.checkpoint: this plan's ZeRO state holds fp32 master copies of "
                                 "low-precision params, which have no place in model coordinates; keep the "
                                 "params in fp32 (--precision selects the compute dtype only).")
            inner = opt_state.inner
        if self.clipped:  # chain(clip, tx): the clip keeps no state
            if not isinstance(inner, tuple) or len(inner) != 2 or tree_util.leaves(inner[0]):
                raise ValueError("cfx.checkpoint: the plan's optimizer state is not (clip, tx) as the plan "
                                 "built it; save the state this program's init and step return.")
            inner = inner[1]
        n = self.mesh.shape.get("data", 1)
        for path, x in tree_util.flatten_with_path(inner)[0]:
            hit = self._mirror(path, x, mirrored, n)
            if hit is None:  # a leaf of its own (a count, a scale): whole, the same on every rank
                shape = tuple(x.shape)
                yield Region(f"opt_state.{path}" if path else "opt_state", (0,) * len(shape), shape), x
                continue
            prefix, (region, _) = hit
            if self.zero in (1, 2):  # a piece of what the params leaf holds on this rank
                region, x = self._piece(region, x, coords)
            elif region.flat is not None:  # ZeRO-3: the params' own piece, padding and all
                x = x[:region.numel]
            if region.numel:
                yield dataclasses.replace(region, path=f"opt_state.{prefix}{region.path}"), x

    def _mirror(self, path: str, x: torch.Tensor, mirrored: dict, n: int):
        """``(path prefix, the params leaf's entry)`` for a state leaf that mirrors a params leaf:
        its path ends with that leaf's and its shape is the leaf's (ZeRO 1/2: the leaf's piece)."""
        parts = path.split(".")
        for i in range(len(parts)):
            hit = mirrored.get(".".join(parts[i:]))
            if hit is None:
                continue
            shape = hit[1]
            want = (piece_size(math.prod(shape), n),) if self.zero in (1, 2) else shape
            if tuple(x.shape) == want:
                return "".join(p + "." for p in parts[:i]), hit
        return None

    def _model_path(self, path: str, coords: dict) -> str:
        """A view leaf's path in the model's tree: a pipe stage's row ``j`` of ``blocks`` is the
        model block its rank runs there."""
        if not self.layout.stacked or not path.startswith("blocks."):
            return path
        _, j, rest = path.split(".", 2)
        row = coords["pipe"] * self.layout.rows_per_rank + int(j)
        return f"blocks.{self.layout.order[row]}.{rest}"

    # -- every rank --------------------------------------------------------------------------------
    def owners(self, params: Any, opt_state: Any) -> dict[Region, int]:
        """The lowest rank holding each region (it writes it), from any rank's blocks as a template
        of every rank's shapes (stored layouts give every rank blocks of the same shapes)."""
        meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
        params, opt_state = tree_util.map(meta, params), tree_util.map(meta, opt_state)
        out: dict[Region, int] = {}
        for rank in range(self.mesh.size):
            for region, _ in self.entries(rank, params, opt_state):
                out.setdefault(region, rank)
        return out
