"""From a solved plan to a step that runs: the traced graph interpreted on every rank's blocks.

``lower(graph, solved, mesh)`` returns ``step(params, *batch) -> (loss, grads)``, one
``shard_map`` over ``mesh`` whose body walks the traced aten graph (forward and backward are both
in it, so nothing is differentiated at run time) with each op's chosen ``Strategy``:

1. each tensor input is moved from its producer's layout to the one the strategy reads
   (``cfx.reshard``'s planned collectives on the rank's block: a slice, an all-gather, an
   all-to-all -- the edges the search priced);
2. the op runs on the blocks, its size arguments rewritten to its output's block (``view``,
   ``expand``, ``slice_backward`` ...), a few ops by their own rule (``_RULES``: views become
   reshapes, since a block's strides need not be the one-device tensor's; a vocabulary-split
   embedding masks the ids other ranks own; ``addmm`` split along its contraction adds its bias
   once, after the sum; a row-split ``nll_loss`` divides by the global weight; a ``mean`` over a
   split dimension by the number of blocks);
3. a partial output (``Strategy.partial``: a contraction or reduction over a split dimension) is
   summed over its axes at once, as the search charged it.

The loss comes back replicated, each gradient in its param's spec: what the graph computes on one
device, up to the order of float sums.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable

import torch

from cfx._src.core import tree as tree_util
from cfx._src.autoshard.graph import Graph
from cfx._src.autoshard.specs import Strategy, entries
from cfx._src.lax import comm, groups
from cfx._src.mesh.mesh import AbstractMesh
from cfx._src.mesh.spec import P
from cfx._src.spmd.resharding import find_path, run_steps
from cfx._src.spmd.shard_map import shard_map

aten = torch.ops.aten
_SIZE_ARG = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
             aten.slice_backward.default: 1, aten.select_backward.default: 1, aten.new_zeros.default: 1,
             aten.new_empty.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1}


def lower(graph: Graph, choices: list[Strategy], mesh, *, param_tree: Any, batch_tree: Any) -> Callable:
    """``step(params, *batch) -> (loss, grads)`` running ``choices`` (one per op) on ``mesh``
    (module doc). ``param_tree`` / ``batch_tree``: the pytrees ``graph`` was traced with."""
    nodes = list(graph.module.graph.nodes)
    p_specs = tree_util.unflatten(tree_util.structure(param_tree), [choices[i].out for i in graph.params])
    b_specs = tree_util.unflatten(tree_util.structure(batch_tree), [choices[i].out for i in graph.batch])

    def body(params, *batch):
        leaves = tree_util.leaves(params) + tree_util.leaves(batch)
        with torch.no_grad():
            return _Interpreter(nodes, choices, mesh).run(leaves, graph, p_specs)

    mapped = shard_map(body, mesh=mesh, in_specs=(p_specs, *b_specs), out_specs=(P(), p_specs))
    mapped.param_specs, mapped.batch_specs = p_specs, b_specs
    return mapped


class _Interpreter:
    """One rank's walk over the graph: each node's local value and the layout it is in."""

    def __init__(self, nodes: list, choices: list[Strategy], mesh):
        self.nodes, self.choices, self.mesh = nodes, choices, mesh
        self.index = {n: i for i, n in enumerate(nodes)}
        self.value: dict[int, Any] = {}
        self.layout: dict[int, P] = {}  # the spec of each single-tensor value

    def run(self, leaves: list, graph: Graph, p_specs: Any) -> tuple:
        uses = _last_uses(self.nodes)
        feed = iter(leaves)
        self.device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))
        for i, n in enumerate(self.nodes):
            if n.op == "placeholder":
                self.value[i], self.layout[i] = next(feed), self.choices[i].out
            elif n.op == "call_function":
                self._call(i, n)
            for j in uses.get(i, ()):  # free what no later op reads
                self.value.pop(j, None)
        out = self.nodes[-1].args[0]
        loss = self._moved(out[0], P())
        grads = [self._moved(g, self.choices[p].out) for g, p in zip(out[1:], graph.params)]
        return loss, tree_util.unflatten(tree_util.structure(p_specs, is_leaf=lambda x: isinstance(x, P)), grads)

    def _moved(self, node, dst: P) -> torch.Tensor:
        """``node``'s block in layout ``dst``."""
        i = self.index[node]
        x, src = self.value[i], self.layout[i]
        if src == dst:
            return x
        return run_steps(x, _steps(src, dst, tuple(node.meta["val"].shape), self.mesh, x.element_size(), ()))

    def _call(self, i: int, n) -> None:
        s = self.choices[i]
        if n.target is operator.getitem:
            parent, k = n.args
            self.value[i] = self.value[self.index[parent]][k]
        else:
            ins = {a: self._moved(a, spec) if spec is not None else self.value[self.index[a]]
                   for a, spec in zip(n.all_input_nodes, s.ins or (None,) * len(n.all_input_nodes))}
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), ins.__getitem__)
            if kwargs.get("device") is not None:  # traced on fake tensors: made on the rank's device
                kwargs = {**kwargs, "device": self.device}
            if n.target in _SIZE_ARG:
                args = list(args)
                args[_SIZE_ARG[n.target]] = _block_shape(n.meta["val"].shape, s.out, self.mesh)
            rule = _RULES.get(n.target)
            try:
                self.value[i] = rule(n, s, args, kwargs, self.mesh) if rule else n.target(*args, **kwargs)
            except RuntimeError as e:  # a library bug: name the op and its strategy
                raise RuntimeError(f"cfx.autoshard: {n.name} ({n.target}) failed under {s}: {e}") from e
            if rule is not None and n.target is aten.addmm.default:
                self.layout[i] = s.out
                return  # the rule summed the partial products before adding the bias
        self.layout[i] = s.out
        if s.partial and isinstance(self.value[i], torch.Tensor):
            self.value[i] = _summed(self.value[i], s.out, s.partial, self.mesh)


def _steps(src: P, dst: P, shape: tuple, mesh, itemsize: int, partial: tuple) -> tuple:
    """``reshard``'s planned steps (searched once per layout change, not per rank and step)."""
    return _planned(src, dst, shape, tuple(mesh.shape.items()), itemsize, partial)


@functools.lru_cache(maxsize=4096)
def _planned(src: P, dst: P, shape: tuple, mesh_shape: tuple, itemsize: int, partial: tuple) -> tuple:
    return find_path(src, dst, shape, AbstractMesh(dict(mesh_shape)), itemsize=itemsize, partial=partial).steps


def _summed(x: torch.Tensor, spec: P, axes: tuple, mesh) -> torch.Tensor:
    """Partial sums over ``axes`` of a block laid out by ``spec``, reduced."""
    return run_steps(x, _steps(spec, spec, _global_shape(x.shape, spec, mesh), mesh, x.element_size(), tuple(axes)))


def _last_uses(nodes: list) -> dict[int, list[int]]:
    """For each node, the inputs it is the last reader of (freed after it runs)."""
    index = {n: i for i, n in enumerate(nodes)}
    last: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[index[a]] = i
    out: dict[int, list[int]] = {}
    for j, i in last.items():
        if nodes[i].op != "output":
            out.setdefault(i, []).append(j)
    return out


def _block_shape(shape, spec: P, mesh) -> list[int]:
    e = entries(spec, len(shape))
    return [d // math.prod(mesh.shape[a] for a in axes) for d, axes in zip(shape, e)]


def _global_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    e = entries(spec, len(shape))
    return tuple(d * math.prod(mesh.shape[a] for a in axes) for d, axes in zip(shape, e))


def _embedding(n, s: Strategy, args, kwargs, mesh):
    """A table split along its vocabulary: each rank looks up the ids it owns, zeros for the rest."""
    weight, ids = args[0], args[1]
    vocab = entries(s.ins[0], 2)[0]
    if not vocab:
        return n.target(*args, **kwargs)
    rows = weight.shape[0]
    first = groups.index_of(groups.axes(vocab, "cfx.autoshard")) * rows
    mine = (ids >= first) & (ids < first + rows)
    out = aten.embedding.default(weight, torch.where(mine, ids - first, torch.zeros_like(ids)), *args[2:])
    return out * mine.unsqueeze(-1).to(out.dtype)


def _addmm(n, s: Strategy, args, kwargs, mesh):
    """A contraction split over ranks: the products summed first, the bias added once."""
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not s.partial:
        return n.target(*args, **kwargs)
    return beta * bias + alpha * _summed(torch.mm(a, b), s.out, s.partial, mesh)


def _nll_loss(n, s: Strategy, args, kwargs, mesh):
    """Rows split over ranks: each rank's summed loss over the global weight (the sum over ranks
    of these partial values is the mean); the weight stays this rank's (the getitem sums it)."""
    rows = dict(s.reduces).get(0, ())
    reduction = args[3]
    if not rows or reduction != 1:  # no split, or "sum" (partial sums as they are)
        return n.target(*args, **kwargs)
    total, weight = n.target(*args[:3], 2, *args[4:])
    everywhere = comm.all_reduce(weight, groups.axes(rows, "cfx.autoshard"), "sum")
    return total / everywhere, weight


def _mean(n, s: Strategy, args, kwargs, mesh):
    """A mean over split dimensions: each block's mean over the number of blocks."""
    out = n.target(*args, **kwargs)
    return out / math.prod(mesh.shape[a] for a in s.partial) if s.partial else out


def _view(n, s: Strategy, args, kwargs, mesh):
    """A view of a block whose strides a layout change reset (a gathered transpose is contiguous
    where the one-device tensor was not): a reshape, copying only where a view cannot be taken."""
    return torch.reshape(args[0], args[1])


_RULES = {aten.view.default: _view, aten._unsafe_view.default: _view, aten.embedding.default: _embedding, aten.addmm.default: _addmm, aten.nll_loss_forward.default: _nll_loss,
          aten.mean.dim: _mean, aten.mean.default: _mean}
