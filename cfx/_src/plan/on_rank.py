"""Code run on shapes in one rank's context, before any rank exists: the specs of per-rank state
(``per_rank_specs``) and what ``Plan.describe`` measures."""
from __future__ import annotations

from typing import Any

from cfx._src.core import tree as tree_util
from cfx._src.mesh.context import Group, RankContext, installed
from cfx._src.mesh.spec import P
from cfx._src.transforms.shapes import eval_shape


def eval_on_rank(mesh, fn, *args) -> Any:
    """``eval_shape(fn, *args)`` in rank 0's context: axis sizes and indices, no process groups
    (a collective would raise), no allocation. ``mesh`` may be an ``AbstractMesh``."""
    coords = mesh.coords(0)
    ctx = RankContext(mesh, 0, coords, lambda axes: Group(axes, mesh.axes_size(axes), mesh.index_in(axes, coords), None))
    with installed(ctx):
        return eval_shape(fn, *args)


def per_rank_specs(mesh, fn, *args) -> Any:
    """Specs for what ``fn(*args)`` returns on each rank when every rank's result has the same
    shapes but its own values (ZeRO's flat state): 1-D and larger leaves split over all of the
    mesh's axes, scalars replicated."""
    every = tuple(mesh.axis_names)
    return tree_util.map(lambda x: P(every) if len(x.shape) else P(), eval_on_rank(mesh, fn, *args))
