"""Cut a decoder's blocks into pipeline stages: ``partition(model, n_stages) -> Partition``.

Stages are contiguous runs of blocks, at least one block each, balanced by a per-block cost:
parameter counts by default (counted on fake tensors, nothing is allocated), or costs you give
(profiled FLOPs or seconds). Balanced means the most expensive stage is as cheap as possible
(the pipeline's pace is its slowest stage) and, among such cuts, the stage costs are as even
as possible (least sum of squares); the tie-break is deterministic.

Besides its blocks the first stage runs the embeddings and the last the final norm, the LM
head and the loss (``Partition.first`` / ``.last`` name those top-level params). A tied head
(GPT-2's ``wte``, a Llama with ``tie_embeddings``) is in both: ``Partition.tied``. Its two
gradient contributions live on the first and the last stage's ranks and are summed over the
pipe axis (see ``executor.py``), so both copies take the same update.

The model says how it splits into embedding, blocks and head through the parts protocol
(``model.parts()``, ``cfx/_src/models/parts.py``); no model family is named here. The blocks
run through their own ``apply`` (so ``map_blocks`` wrappers: ``cfx.remat``, tensor parallelism,
take effect per stage).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from torch._subclasses.fake_tensor import FakeTensorMode

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.models.parts import ModelParts, parts_of
from cfx._src.remat.chained import Chained


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which blocks and extra parts each of ``n_stages`` virtual stages runs.

    ``bounds[s]:bounds[s+1]`` are stage s's blocks; stage 0 also runs the params named in
    ``first``, the last stage those in ``last``; ``costs`` are the per-block costs balanced.
    """

    bounds: tuple[int, ...]   # (n_stages + 1,) block boundaries, 0 .. n_blocks
    first: tuple[str, ...]    # top-level params of the embedding (stage 0)
    last: tuple[str, ...]     # top-level params of the final norm and head (last stage)
    costs: tuple[float, ...]  # (n_blocks,)

    @property
    def n_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def tied(self) -> tuple[str, ...]:
        """Top-level params used by both the first and the last stage."""
        return tuple(k for k in self.first if k in self.last)

    def blocks(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def extras(self, stage: int) -> tuple[str, ...]:
        """Top-level params other than blocks that ``stage`` runs."""
        out = self.first if stage == 0 else ()
        if stage == self.n_stages - 1:
            out += tuple(k for k in self.last if k not in out)
        return out

    def stage_cost(self, stage: int) -> float:
        return sum(self.costs[i] for i in self.blocks(stage))

    def __str__(self) -> str:
        rows = []
        for s in range(self.n_stages):
            b = self.blocks(s)
            extra = f" + {', '.join(self.extras(s))}" if self.extras(s) else ""
            rows.append(f"stage {s}: blocks {b.start}..{b.stop - 1}{extra} (cost {self.stage_cost(s):g})")
        return "\n".join(rows)


def model_parts(model: Any) -> ModelParts:
    """The model's parts protocol (``cfx/_src/models/parts.py``), checked for a pipeline."""
    where = f"cfx.pipeline({type(model).__name__})"
    if isinstance(model, Chained):
        raise ValueError(f"{where}: the model runs its blocks under a cfx.remat.solve plan, which "
                         "spans all blocks; a pipeline cuts them into stages. Drop the plan and "
                         "remat per block: model.map_blocks(cfx.remat).")
    return parts_of(model, where)


def param_counts(model: Any) -> list[int]:
    """Parameters per block, counted on fake tensors (each distinct block initialised once)."""
    counts: dict[Any, int] = {}
    out = []
    with FakeTensorMode():
        for b in model.blocks:
            key = b if _hashable(b) else id(b)
            if key not in counts:
                counts[key] = tree_util.size(b.init(random.key(0)))
            out.append(counts[key])
    return out


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def partition(model: Any, n_stages: int, *, costs: Sequence[float] | None = None) -> Partition:
    """Contiguous, balanced stages of ``model.blocks`` (see the module docstring)."""
    parts = model_parts(model)
    n = len(model.blocks)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"partition: n_stages must be an integer >= 1, got {n_stages!r}.")
    if n_stages > n:
        raise ValueError(f"partition: {n_stages} stages but the model has only {n} blocks; every "
                         f"stage needs at least one. Use at most {n} stages (a smaller pipe axis or "
                         f"fewer chunks v per rank) or a model with more layers.")
    if costs is None:
        costs = param_counts(model)
    costs = tuple(float(c) for c in costs)
    if len(costs) != n or any(not c >= 0 for c in costs):
        raise ValueError(f"partition: costs must be {n} numbers >= 0, one per block; got "
                         f"{len(costs)} values {list(costs)[:8]}.")
    return Partition(_balanced_bounds(costs, n_stages), parts.first, parts.last, costs)


def _balanced_bounds(costs: tuple[float, ...], k: int) -> tuple[int, ...]:
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:  # cost of blocks i..j-1
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[s][j]: least bottleneck cutting blocks 0..j-1 into s stages
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            best[s][j] = min(max(best[s - 1][i], seg(i, j)) for i in range(s - 1, j))
    cap = best[k][n] * (1 + 1e-9) + 1e-12
    # among cuts within the bottleneck, the least sum of squared stage costs
    sq = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[-1] * (n + 1) for _ in range(k + 1)]
    sq[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                c = seg(i, j)
                if c <= cap and sq[s - 1][i] + c * c < sq[s][j]:
                    sq[s][j], arg[s][j] = sq[s - 1][i] + c * c, i
    bounds, j = [n], n
    for s in range(k, 0, -1):
        j = arg[s][j]
        bounds.append(j)
    assert bounds[-1] == 0 and len(bounds) == k + 1, bounds
    return tuple(reversed(bounds))
