"""``cfx.autoshard``: from a single-device train step to the fastest sharded one that fits.

    step_auto, report = cfx.autoshard(step, mesh, (params, x, y), memory_budget="2GiB")
    loss, grads = step_auto(params, x, y)     # grads laid out like report.specs
    print(report)

The four stages, each its own module: ``graph.trace`` records the step's forward and backward as
aten ops on fake tensors; ``strategies`` lists each op's ways to split over the mesh; ``search``
prices them (``CostModel``, or ``calibrate(mesh)``'s measured one) and solves the ILP within the
budget; ``lower`` runs the chosen strategies on each rank's blocks. ``reference=`` prices a
hand-written plan (a param-spec dict, e.g. Megatron's) under the same model for the report.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from cfx._src.core import tree as tree_util
from cfx._src.autoshard.calibrate import calibrate
from cfx._src.autoshard.cost import CostModel
from cfx._src.autoshard.graph import Graph, trace
from cfx._src.autoshard.lower import lower
from cfx._src.autoshard.ilp import NoPlanFits
from cfx._src.autoshard.report import Reference, Report, collectives, gathered
from cfx._src.autoshard.search import search
from cfx._src.autoshard.specs import entries
from cfx._src.mesh.spec import P
from cfx._src.plan.layout import put_tree
from cfx._src.core.text import format_bytes, parse_bytes


class AutoStep:
    """The solved plan as a callable: ``step_auto(params, *batch) -> (loss, grads)``, every
    argument checked against the example it was traced with (shape and dtype per leaf)."""

    def __init__(self, graph: Graph, choices: list, mesh, example: tuple):
        self.graph, self.choices, self.mesh = graph, choices, mesh
        self._examples = [(p, tuple(x.shape), x.dtype) for p, x in tree_util.flatten_with_path(example)[0]]
        self._run = lower(graph, choices, mesh, param_tree=example[0], batch_tree=example[1:])
        self.param_specs, self.batch_specs = self._run.param_specs, self._run.batch_specs

    def __call__(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        got = tree_util.flatten_with_path((params, *batch))[0]
        if len(got) != len(self._examples):
            raise ValueError(f"cfx.autoshard: the step was traced with {len(self._examples)} tensors (params and "
                             f"batch) and is called with {len(got)}; call it with the example's structure.")
        for (path, x), (_, shape, dtype) in zip(got, self._examples):
            path = f"params.{path[2:]}" if path.startswith("0.") else f"batch[{int(path.split('.')[0]) - 1}]" + \
                "".join(f".{q}" for q in path.split(".")[1:])
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise ValueError(f"cfx.autoshard: argument {path} is {tuple(x.shape)} {x.dtype} but the plan was "
                                 f"searched for {shape} {dtype} (on mesh {dict(self.mesh.shape)}); run "
                                 "cfx.autoshard again with an example of these shapes.")
        return self._run(params, *batch)

    def put(self, params: Any) -> Any:
        """``params`` laid out in the plan's specs (ShardedArrays), each rank keeping its block."""
        return put_tree(params, self.param_specs, self.mesh)


def autoshard(step: Callable[..., torch.Tensor], mesh, example_args: tuple, *, memory_budget: int | str | None = None,
              cost: CostModel | None = None, reference: dict[str, P] | None = None,
              reference_name: str = "reference", fixed: dict[str, P] | None = None) -> tuple[AutoStep, Report]:
    """Search ``step(params, *batch) -> loss`` over ``mesh`` (module doc). ``example_args`` is
    ``(params, *batch)``: real tensors or ``ShapeDtype`` leaves. ``memory_budget``: bytes per rank
    (``"2GiB"``) for params, grads, AdamW moments and saved activations; ``NoPlanFits`` (a
    ValueError) when no plan meets it. ``fixed`` pins some params' specs (by pytree path)."""
    if not isinstance(example_args, tuple) or not example_args:
        raise ValueError("cfx.autoshard: example_args must be a tuple (params, *batch), e.g. (params, x, y).")
    budget = math.inf if memory_budget is None else parse_bytes(memory_budget)
    cost = cost or CostModel()
    mesh_shape = dict(mesh.shape)
    start = time.perf_counter()
    graph = trace(step, *example_args)
    try:
        solved = search(graph, mesh_shape, cost=cost, budget=budget, fixed=fixed)
    except NoPlanFits as e:
        least = sum(float(m.min()) for m in e.problem.memory) if getattr(e, "problem", None) else None
        raise NoPlanFits(
            f"cfx.autoshard on mesh {mesh_shape}: no strategy assignment fits {format_bytes(budget)} per rank"
            + (f"; the least any op-by-op choice needs is {format_bytes(least)}" if least is not None else "")
            + " (params with their gradients and AdamW moments, and saved activations). Raise memory_budget, "
              "add ranks, or shrink the batch: this search does not recompute or offload activations.") from None
    ref = None
    if reference is not None:
        priced = search(graph, mesh_shape, cost=cost, fixed=reference)
        ref = Reference(reference_name, priced.solution.objective, priced.solution.memory)
        if priced.solution.objective < solved.solution.objective and priced.solution.memory <= budget:
            solved = priced  # the search stops within 1% of its optimum: a better known plan wins
    solve_s = time.perf_counter() - start
    choices = solved.choices
    param_bytes = {}
    for i in graph.params:
        op = graph.ops[i]
        shards = math.prod(mesh_shape[a] for d in entries(choices[i].out, len(op.shape)) for a in d)
        param_bytes[op.path.removeprefix("params.")] = op.bytes / shards
    report = Report(mesh_shape, dict(solved.specs), param_bytes, tuple(choices[i].out for i in graph.batch),
                    solved.solution.objective, solved.solution.memory, budget,
                    tuple(collectives(graph, choices, mesh_shape, cost)), tuple(gathered(graph, choices)), ref,
                    solve_s, len(graph.ops), tuple(_notes(graph, choices, mesh_shape)), cost.measured)
    return AutoStep(graph, choices, mesh, example_args), report


def _notes(graph: Graph, choices: list, mesh_shape: dict[str, int]) -> list[str]:
    """Batch tensors the mesh cannot split at all (no axis divides any dimension)."""
    out = []
    size = math.prod(mesh_shape.values())
    for i in graph.batch:
        op = graph.ops[i]
        if op.shape and choices[i].out == P() and not any(d % n == 0 for d in op.shape for n in mesh_shape.values()):
            out.append(f"{op.path} of shape {op.shape} has no dimension any mesh axis divides ({mesh_shape}); it is "
                       f"read whole on every rank. A batch divisible by {size} lets the plan split it.")
    return out
