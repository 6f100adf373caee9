"""The grids of Colossal-AI's multi-dimensional tensor parallelism, as data: where a transformer
block's activations and weights lie, and which collectives a Linear issues between two layouts.

Every scheme names its mesh axes ``row``, ``col`` and (2.5D, 3D) ``dep`` (the names are choosable).
An activation ``(B, T, C)`` is laid out by a ``Layout``: its batch split over ``batch`` (major to
minor), its features over ``feature``; the block's residual stream lives in ``TensorGrid.a``.

* **2D** (Optimus, Xu et al. 2021; SUMMA): a ``q x q`` grid. Activations ``P("row", None, "col")``,
  every weight ``(in, out)`` ``P("row", "col")``. ``y = x @ w`` is computed as
  ``all_gather(x, col, dim=-1) @ all_gather(w, row, dim=0)``: SUMMA's row and column broadcasts as one
  all-gather each; the transposes (``psum_scatter``) are the backward's reductions.
* **2.5D** (Tesseract, Wang et al. 2021): ``q x q x d``; the 2D grid repeated over ``dep`` ranks that
  share the weights and split the batch further, ``P(("dep", "row"), None, "col")``; a weight's
  gradient is also summed over ``dep`` (``pvary``'s transpose).
* **3D** (Bian et al. 2021): a ``q x q x q`` cube. Two layouts alternate: ``A = P(("dep", "row"),
  None, "col")`` and ``B = P(("dep", "col"), None, "row")``. A Linear ``A -> B`` with weight
  ``P(("col", "dep"), "row")``: all-gather ``x`` over ``row`` (its batch), ``w`` over ``dep`` (its
  input dim), multiply (partial sums over ``col``), reduce-scatter over ``col`` (into the batch).
  ``B -> A`` swaps ``row`` and ``col``; q/k/v and the MLP's first Linear go ``A -> B``, the
  attention runs in ``B``, ``o`` and the MLP's last Linear come back to ``A``.

Params replicated over an axis the activations vary over (biases, norm scales; 2.5D's weights over
``dep``) are ``pvary``'d over it, one axis at a time, so their gradients come out summed (JAX's
transpose) with each rank talking only to its ``row``, ``col`` and ``dep`` groups.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from cfx._src.lax import collectives as lax
from cfx._src.lax import vma
from cfx._src.mesh import context as ctx_lib
from cfx._src.mesh.spec import P
from cfx._src.spmd.resharding import Step, run_steps

MODES = ("2d", "2.5d", "3d")
DEFAULT_AXES = {"2d": ("row", "col"), "2.5d": ("row", "col", "dep"), "3d": ("row", "col", "dep")}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Activations ``(B, T, C)``: ``B`` split over ``batch`` (major to minor), ``C`` over ``feature``."""

    batch: tuple[str, ...]
    feature: str

    def spec(self) -> P:
        return P(self.batch if len(self.batch) > 1 else self.batch[0], None, self.feature)


@dataclasses.dataclass(frozen=True)
class LinearSplit:
    """How a Linear ``(in, out)`` runs from layout ``src`` to ``dst`` (module doc)."""

    src: Layout
    dst: Layout
    x_gather: tuple[str, int]     # (axis, dim): the all-gather of the input
    w_spec: P                     # the weight's spec
    w_vary: tuple[str, ...]       # axes the weight is replicated over but meets varying values on (2.5D: dep)
    w_gather: str                 # the axis its input dim is all-gathered over
    scatter: str | None           # the axis the output's batch is reduce-scattered over (3D)
    b_spec: P                     # the bias's spec
    b_vary: tuple[str, ...]       # axes the bias is pvary'd over


def vary(t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """``t`` pvary'd over each of ``axes`` in turn: its gradient is summed over each (one
    all-reduce per axis, so a rank only ever talks to the groups of single grid axes)."""
    for a in axes:
        t = lax.pvary(t, a)
    return t


def allsum(x: torch.Tensor, axis: str) -> torch.Tensor:
    """The sum over ``axis`` used where each rank's use of it differs: an all-reduce forward and
    (``pvary``'s transpose) an all-reduce of the cotangents backward."""
    return lax.pvary(lax.psum(x, axis), axis)


@dataclasses.dataclass(frozen=True)
class TensorGrid:
    """A multi-dimensional tensor-parallel scheme (``mode``: ``2d``, ``2.5d``, ``3d``) over mesh axes
    ``axes`` = ``(row, col)`` or ``(row, col, dep)`` (defaults ``DEFAULT_AXES``)."""

    mode: str = "2d"
    axes: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"TensorGrid: unknown mode {self.mode!r}; use one of {MODES}.")
        axes = DEFAULT_AXES[self.mode] if self.axes is None else tuple(self.axes)
        want = len(DEFAULT_AXES[self.mode])
        if len(axes) != want or len(set(axes)) != want or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"TensorGrid({self.mode!r}): axes must be {want} distinct mesh axis names "
                             f"{DEFAULT_AXES[self.mode]}, got {self.axes!r}.")
        object.__setattr__(self, "axes", axes)

    @property
    def row(self) -> str:
        return self.axes[0]

    @property
    def col(self) -> str:
        return self.axes[1]

    @property
    def dep(self) -> str | None:
        return self.axes[2] if len(self.axes) == 3 else None

    @property
    def a(self) -> Layout:
        """The residual stream's layout (the block's input and output)."""
        return Layout(((self.dep,) if self.dep else ()) + (self.row,), self.col)

    def linear(self, src: Layout) -> LinearSplit:
        """The split of a Linear whose input is laid out by ``src``."""
        if self.mode != "3d":  # SUMMA on the (row, col) grid; 2.5D: weights shared over dep
            w_vary = (self.dep,) if self.dep else ()
            return LinearSplit(src, src, (self.col, -1), P(self.row, self.col), w_vary, self.row, None,
                               P(self.col), src.batch)
        s, f = src.batch[-1], src.feature  # 3D: batch (dep, s), features over f -> batch (dep, f), features s
        return LinearSplit(src, Layout((self.dep, f), s), (s, 0), P((f, self.dep), s), (), self.dep, f,
                           P(s), (self.dep, f))

    @property
    def inner(self) -> Layout:
        """The layout the attention core and the MLP's activation run in (3D: ``B``)."""
        return self.linear(self.a).dst

    # -- sizes -------------------------------------------------------------------------------------
    def sizes(self, where: str) -> tuple[int, int]:
        """``(q, d)`` of the grid this rank runs on; ValueError naming the mesh unless it is square
        (``row == col``, and ``dep == q`` for 3D)."""
        mesh = ctx_lib.current(where).mesh
        mesh.check_axes(self.axes, where)
        q, c = mesh.shape[self.row], mesh.shape[self.col]
        d = mesh.shape[self.dep] if self.dep else 1
        if q != c or (self.mode == "3d" and d != q):
            shape = " x ".join(f"{a}={mesh.shape[a]}" for a in self.axes)
            need = "a q x q x q cube (row = col = dep)" if self.mode == "3d" else "a q x q grid (row = col)"
            raise ValueError(f"{where}: {self.mode} tensor parallelism needs {need}, got {shape} on {mesh!r}; "
                             "give the mesh equal axis sizes.")
        return q, d

    # -- into and out of the grid --------------------------------------------------------------------
    def enter(self, x: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
        """A ``(B, T, C)`` value replicated over the grid -> this rank's block of ``layout`` (default
        ``a``): local slices forward, all-gathers backward (``reshard``'s steps)."""
        layout = layout or self.a
        steps = tuple(Step("split", a, 0) for a in layout.batch) + (Step("split", layout.feature, x.dim() - 1),)
        return vma.declare_varying(run_steps(x, steps), self.axes)

    def leave(self, x: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
        """This rank's block of ``layout`` -> the whole ``(B, T, C)`` value, replicated over the grid:
        all-gathers forward, this rank's slices of the (replicated) cotangent backward."""
        layout = layout or self.a
        steps = (Step("all_gather", layout.feature, x.dim() - 1),) + tuple(
            Step("all_gather", a, 0) for a in reversed(layout.batch))
        out = run_steps(x, steps)
        if vma.is_tracking():
            vma.mark(out, vma.varying_axes(x) - set(self.axes))
        return out

    def rows(self, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's rows of a value replicated over the grid whose dim 0 is the batch (a mask,
        positions): the rows ``layout`` gives it; no gradient flows."""
        n = math.prod(lax.axis_size(a) for a in layout.batch)
        return t.chunk(n, 0)[lax.axis_index(layout.batch)]

    def block_of(self, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's block of a ``(B, T, C)`` value every rank holds whole (a dropout mask)."""
        t = self.rows(t, layout)
        return t.chunk(lax.axis_size(layout.feature), -1)[lax.axis_index(layout.feature)]
