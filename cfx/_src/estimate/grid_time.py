"""What a 2D / 2.5D / 3D tensor-parallel grid sends, read from its own step: ``grid_records``.

A grid (``tp=2d|2.5d|3d``: ``cfx.parallel.tensor_parallel_grid``) splits every matmul's operands over
``row`` x ``col`` (x ``dep``) and moves blocks of them between the grid's ranks in patterns of
all-gathers, reduce-scatters and all-reduces per scheme (SUMMA's, Tesseract's, the 3D cube's). Rather
than a second formula of those patterns, the estimate runs the step itself on shapes for one rank of the
grid (``cfx._src.plan.rehearse``: fake tensors, nothing computed or allocated) at the model's real widths
with one and with two layers and no data axis: the two-layer step's collectives less the one-layer
step's are one layer's, the rest are the embedding's, the head's and the loss's. Every rank of a grid
does the same work on blocks of the same shapes, so rank 0 speaks for all. The records are remembered
per (shape, grid, precision, rows, seq).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import torch

from cfx._src.estimate.workload import TransformerShape
from cfx._src.lax.stats import CommRecord


@dataclasses.dataclass(frozen=True)
class GridRecords:
    """One rank's collectives of a grid step: those of each layer, and those outside the layers."""

    layer: tuple[CommRecord, ...]
    rest: tuple[CommRecord, ...]


def grid_records(shape: TransformerShape, plan: Any, rows: int, seq: int) -> GridRecords:
    """The collectives one rank of ``plan``'s grid sends in a step on ``rows`` x ``seq`` tokens of its data
    rank (module doc)."""
    grid = ",".join(f"{a}={plan.size(a)}" for a in ("row", "col", "dep") if plan.has(a))
    return _records(shape, f"{grid} tp={plan.tp} remat={plan.remat} precision={plan.precision}", rows, seq)


@functools.lru_cache(maxsize=256)
def _records(shape: TransformerShape, text: str, rows: int, seq: int) -> GridRecords:
    one, two = (_rank0(_model(shape, n, seq), text, rows, seq) for n in (1, 2))
    per_layer = _minus(two, one)
    return GridRecords(per_layer, _minus(one, per_layer))


def _model(shape: TransformerShape, layers: int, seq: int) -> Any:
    """A cfx decoder of ``shape``'s widths with ``layers`` layers (``families.decoder_of_shape``)."""
    from cfx._src.models.families import decoder_of_shape

    if shape.experts:
        raise ValueError("cfx.parallel.estimate: a tp= grid splits dense TransformerBlocks; this shape is a mixture "
                         "of experts. Estimate it with model= / expert= axes instead.")
    return decoder_of_shape(shape.hidden, layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab,
                            gated=shape.gated, positions=seq)


def _rank0(model: Any, text: str, rows: int, seq: int) -> list[CommRecord]:
    from cfx._src.mesh.mesh import AbstractMesh
    from cfx._src.optim.alias import adamw
    from cfx._src.plan.build import arrange_batch
    from cfx._src.plan.plan import Plan
    from cfx._src.plan.program import Program
    from cfx._src.plan.rehearse import rehearse

    plan = Plan.parse(text)
    program = Program(plan, model, adamw(1e-3), AbstractMesh(plan.mesh_shape))
    tokens = torch.zeros((rows, seq), dtype=torch.long)
    body = program.body_for(arrange_batch(plan, model, (tokens, tokens)))
    return list(rehearse(program, body, rows, seq, 0).records)


def _minus(a: list | tuple, b: list | tuple) -> tuple[CommRecord, ...]:
    """The records of ``a`` not matched one for one (op, axes, phase, size) by ``b``'s."""
    left = collections.Counter((r.op, r.axes, r.backward, r.nbytes) for r in b)
    out = []
    for r in a:
        key = (r.op, r.axes, r.backward, r.nbytes)
        if left[key]:
            left[key] -= 1
        else:
            out.append(r)
    return tuple(out)
