"""From a traced step to the ILP and back: each op's strategies costed on a mesh, the edges'
resharding priced by ``cfx.reshard``'s cheapest collectives, the solver's choice read out.

Costs are seconds under a ``CostModel``: an op's FLOPs over its split and the rank's throughput,
the bytes it writes on a rank over the memory bandwidth (unless it is a view), plus the
all-reduce of a partial output; an edge's collectives as ``latency + bytes / bandwidth``
per step (alpha-beta per mesh axis, ``cost.py``). Memory per rank: a param's spec keeps it, its
gradient and AdamW's two moments (4x its block); a batch input's block and a forward op's output
are counted as held for backward (the upper bound remat lowers). A param's gradient must end in the
param's own spec (an edge from the op that makes it back to the param), so data parallelism pays
its gradient all-reduce and ZeRO-like splits their reduce-scatter. ``search`` solves the problem
``coarsen.py`` reduces this one to, exactly, and expands its choice to every op.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numpy as np

from cfx._src.autoshard.cost import CostModel
from cfx._src.autoshard.graph import Graph
from cfx._src.autoshard.coarsen import coarsen as coarsened
from cfx._src.autoshard.ilp import INFEASIBLE, NoPlanFits, Problem, Solution, infeasible, solve
from cfx._src.autoshard.specs import Strategy, entries
from cfx._src.autoshard.strategies import ALIASING, strategies
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.mesh.spec import P
from cfx._src.spmd.resharding import find_path


@dataclasses.dataclass(frozen=True)
class Solved:
    solution: Solution
    specs: dict[str, P]               # each param's spec, by pytree path
    choices: list[Strategy]           # per op
    problem: Problem


def build(graph: Graph, mesh_shape: dict[str, int], *, cost: CostModel = CostModel(),
          budget: float = math.inf, fixed: dict[str, P] | None = None) -> tuple[Problem, list[list[Strategy]]]:
    """The ILP of ``graph`` on a mesh of ``mesh_shape`` (module doc) and each op's strategies;
    ``fixed`` pins params (by pytree path) to a spec (e.g. Megatron's, to price that plan)."""
    mesh = AbstractMesh(mesh_shape)
    nodes = list(graph.module.graph.nodes)
    out_node = nodes[-1]
    index = {n: i for i, n in enumerate(nodes)}
    ops = [i for i, n in enumerate(nodes) if n is not out_node]
    where = {i: k for k, i in enumerate(ops)}
    strats = [strategies(nodes[i], mesh_shape) for i in ops]
    params = set(graph.params)
    for path, want in (fixed or {}).items():
        i = next((i for i in graph.params if graph.ops[i].path == f"params.{path}"), None)
        if i is None:
            raise ValueError(f"cfx.autoshard: fixed names {path!r}, which is not a param of the step.")
        strats[where[i]] = [s for s in strats[where[i]] if s.out == want]
        if not strats[where[i]]:
            raise ValueError(f"cfx.autoshard: param {path!r} of shape {graph.ops[i].shape} cannot take {want!r} on a "
                             f"mesh of {mesh_shape} (an axis does not divide its dimension).")

    @functools.lru_cache(maxsize=None)
    def move(src: P, dst: P, shape: tuple, itemsize: int, partial: tuple = ()) -> float:
        if src == dst and not partial:
            return 0.0
        try:
            steps = find_path(src, dst, shape, mesh, itemsize=itemsize, partial=partial).steps
        except ValueError:
            return math.inf
        return sum(cost.step(s.axis, s.nbytes) for s in steps if s.nbytes)

    costs, memory = [], []
    for k, i in enumerate(ops):
        op = graph.ops[i]
        size = graph.itemsize(i)
        c, m = [], []
        for s in strats[k]:
            shards = math.prod(mesh_shape[a] for d in entries(s.out, len(op.shape or ())) for a in d)
            t = cost.compute(op.flops, s.div)
            if nodes[i].op == "call_function" and nodes[i].target not in ALIASING:
                t += cost.memory(op.bytes / shards)
            if s.partial:
                t += move(s.out, s.out, op.shape, size, tuple(s.partial))
            c.append(t)
            block = op.bytes / shards
            m.append(4 * block if i in params else (block if op.phase in ("forward", "input") else 0.0))
        costs.append(c)
        memory.append(m)
    edges = []
    for k, i in enumerate(ops):
        node = nodes[i]
        for pos, src in enumerate(node.all_input_nodes):
            u = where[index[src]]
            shape, size = graph.ops[index[src]].shape, graph.itemsize(index[src])
            if strats[k][0].source is not None:  # a getitem follows its op's strategy
                R = np.array([[0.0 if b.source == a else INFEASIBLE for b in strats[k]] for a in range(len(strats[u]))])
                edges.append((u, k, R))
                continue
            if shape is None:
                continue
            R = np.array([[move(a.out, b.ins[pos], shape, size) if b.ins and b.ins[pos] is not None else 0.0
                           for b in strats[k]] for a in strats[u]])
            edges.append((u, k, _finite(R)))
    for g, p in zip(graph.outputs[1:], graph.params):  # each gradient ends in its param's spec
        shape, size = graph.ops[g].shape, graph.itemsize(g)
        R = np.array([[move(a.out, b.out, shape, size) for b in strats[where[p]]] for a in strats[where[g]]])
        edges.append((where[g], where[p], _finite(R)))
    return Problem.make(costs, memory, edges, budget), strats


def search(graph: Graph, mesh_shape: dict[str, int], *, cost: CostModel = CostModel(),
           budget: float = math.inf, fixed: dict[str, P] | None = None, coarsen: bool = True,
           gap: float | None = 1e-2) -> Solved:
    """The cheapest strategy per op within ``budget`` bytes per rank, and each param's spec
    (``fixed``: some params' specs given, the rest searched). ``coarsen``: solve the problem
    ``coarsen.py`` reduces it to (the same optimum, far faster); False solves ``build``'s whole.
    ``gap``: the plan is proven within this fraction of the optimum under the cost model
    (``ilp.solve``; None: branch and bound to HiGHS's default 1e-4)."""
    problem, strats = build(graph, mesh_shape, cost=cost, budget=budget, fixed=fixed)
    if coarsen:
        coarse = coarsened(problem)
        try:
            choice = coarse.expand(solve(coarse.problem, gap=gap).choice)
        except NoPlanFits:
            raise infeasible(problem) from None
        sol = Solution(choice, problem.objective(choice), problem.bytes(choice))
    else:
        sol = solve(problem, gap=gap)
    choices = [s[c] for s, c in zip(strats, sol.choice)]
    specs = {graph.ops[i].path.removeprefix("params."): choices[i].out for i in graph.params}
    return Solved(sol, specs, choices, problem)



def _finite(R: np.ndarray) -> np.ndarray:
    """Impossible moves priced far above any plan (the ILP needs finite coefficients)."""
    return np.where(np.isfinite(R), R, INFEASIBLE)
