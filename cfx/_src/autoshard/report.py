"""What the search decided, for a person: each param's spec and bytes per rank, the collectives
the plan inserts (where, which, how many bytes), its estimated step time and memory per rank, and
how it compares with a reference plan priced under the same cost model (e.g. Megatron's)."""
from __future__ import annotations

import collections
import dataclasses
import math

from cfx._src.autoshard.cost import CostModel
from cfx._src.autoshard.graph import Graph
from cfx._src.autoshard.specs import Strategy, entries
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.mesh.spec import P
from cfx._src.spmd.resharding import find_path
from cfx._src.core.text import format_bytes, format_table


@dataclasses.dataclass(frozen=True)
class Collective:
    before: str                    # the op that reads the moved value (or makes the partial sum)
    phase: str                     # "forward" | "backward"
    op: str                        # all_gather / all_to_all / psum / psum_scatter
    axis: str
    step: str                      # e.g. "all_gather(model, dim 1)"
    nbytes: float                  # per rank, ring algorithms
    seconds: float                 # under the cost model


@dataclasses.dataclass(frozen=True)
class Reference:
    name: str
    estimated_s: float
    memory_bytes: float


@dataclasses.dataclass(frozen=True)
class Report:
    mesh: dict[str, int]
    specs: dict[str, P]                     # each param's spec, by pytree path
    param_bytes: dict[str, float]           # ... and its block's bytes on a rank
    batch_specs: tuple[P, ...]
    estimated_s: float                      # the plan's step time under the cost model
    memory_bytes: float                     # per rank: params, grads, AdamW moments, saved activations
    budget: float
    collectives: tuple[Collective, ...]
    gathered: tuple[str, ...]               # params stored split over an axis and gathered to be read
    reference: Reference | None
    solve_s: float
    ops: int
    notes: tuple[str, ...] = ()
    measured_cost: bool = False             # priced by calibrate()'s measured model, not the default constants

    @property
    def verdict(self) -> str | None:
        """``"equal"`` / ``"cheaper"`` than the reference under the cost model (never dearer: the
        reference is one of the plans searched)."""
        if self.reference is None:
            return None
        return "equal" if self.estimated_s >= self.reference.estimated_s * (1 - 1e-9) else "cheaper"

    def summary(self) -> str:
        """The estimate, the comparison with the reference and the notes (``str``: also every param's spec
        and the collectives)."""
        return "\n".join(self._head() + [f"  ({len(self.specs)} params' specs and {len(self.collectives)} "
                                         "collectives: print(report), or --verbose)"])

    def __str__(self) -> str:
        lines = self._head()
        rows = [(path, str(s), format_bytes(self.param_bytes[path])) for path, s in self.specs.items()]
        lines += ["", format_table(rows, ["param", "spec", "bytes per rank"]), ""]
        totals: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for c in self.collectives:
            for key in ((c.phase, c.op, c.axis), (c.phase, "all", "-")):
                totals[key][0] += 1
                totals[key][1] += c.nbytes
                totals[key][2] += c.seconds
        rows = [(ph, op, ax, n, format_bytes(b), f"{t * 1e3:.3f}") for (ph, op, ax), (n, b, t) in sorted(totals.items())]
        lines.append(format_table(rows, ["phase", "collective", "axis", "count", "bytes per rank", "ms"]))
        return "\n".join(lines)

    def _head(self) -> list[str]:
        lines = [f"cfx.autoshard on mesh {self.mesh}: {self.ops} ops searched in {self.solve_s:.1f} s "
                 "(within 1% of the cost model's optimum)",
                 f"  estimated step {self.estimated_s * 1e3:.3f} ms, {format_bytes(self.memory_bytes)} per rank"
                 + (f" (budget {format_bytes(self.budget)})" if math.isfinite(self.budget) else "")]
        if not self.measured_cost:
            lines.append("  (the default cost model's constants, not this machine's: the ms rank plans against "
                         "each other, they are no time to expect; cost=cfx.autoshard.calibrate(mesh) measures them)")
        if self.reference is not None:
            lines.append(f"  {self.reference.name}: {self.reference.estimated_s * 1e3:.3f} ms, "
                         f"{format_bytes(self.reference.memory_bytes)} per rank -> the plan is {self.verdict}"
                         + (f" by {100 * (1 - self.estimated_s / self.reference.estimated_s):.2g}%"
                            if self.verdict == "cheaper" else ""))
        lines.append(f"  batch specs: {', '.join(map(str, self.batch_specs))}")
        if self.gathered:
            lines.append(f"  stored split and gathered at use (ZeRO-3): {len(self.gathered)} params")
        lines.extend(f"  note: {n}" for n in self.notes)
        return lines


def collectives(graph: Graph, choices: list[Strategy], mesh_shape: dict[str, int], cost: CostModel) -> list[Collective]:
    """Every resharding the plan does before an op, and every partial sum it reduces."""
    mesh = AbstractMesh(mesh_shape)
    nodes = list(graph.module.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []

    def add(before: str, phase: str, src: P, dst: P, shape, itemsize: int, partial=()) -> None:
        if src == dst and not partial:
            return
        steps = [s for s in find_path(src, dst, shape, mesh, itemsize=itemsize, partial=tuple(partial)).steps
                 if s.nbytes]
        out.extend(Collective(before, phase, s.op, s.axis, _step_name(s), s.nbytes, cost.step(s.axis, s.nbytes))
                   for s in steps)

    for i, n in enumerate(nodes[:-1]):
        s, op = choices[i], graph.ops[i]
        if s.source is None:
            for pos, a in enumerate(n.all_input_nodes):
                j = index[a]
                if s.ins and s.ins[pos] is not None and graph.ops[j].shape is not None:
                    add(n.name, op.phase, choices[j].out, s.ins[pos], graph.ops[j].shape, graph.itemsize(j))
        if s.partial and op.shape is not None:
            add(n.name, op.phase, s.out, s.out, op.shape, graph.itemsize(i), s.partial)
    for g, p in zip(graph.outputs[1:], graph.params):  # gradients into their params' specs
        add(graph.ops[p].path, "backward", choices[g].out, choices[p].out, graph.ops[g].shape, graph.itemsize(g))
    return out


def gathered(graph: Graph, choices: list[Strategy]) -> list[str]:
    """Params whose spec splits them over an axis that some reader wants them whole over."""
    nodes = list(graph.module.graph.nodes)
    consumers, out = graph.consumers(), []
    for p in graph.params:
        readers = consumers[p]
        ndim = len(graph.ops[p].shape)
        mine = {a for d in entries(choices[p].out, ndim) for a in d}
        for c in readers:
            ins = choices[c].ins
            spec = ins[nodes[c].all_input_nodes.index(nodes[p])] if ins else None
            if spec is not None and mine - {a for d in entries(spec, ndim) for a in d}:
                out.append(graph.ops[p].path.removeprefix("params."))
                break
    return out


def _step_name(s) -> str:
    if s.op == "all_to_all":
        return f"all_to_all({s.axis}, dim {s.dim} -> {s.to_dim})"
    if s.op == "psum":
        return f"psum({s.axis})"
    return f"{s.op}({s.axis}, dim {s.dim})"
