"""A train step as the auto-parallel search sees it: an aten graph of its forward and backward,
traced on fake tensors (nothing runs, nothing is allocated), each op profiled.

``trace(step, params, *batch)`` differentiates ``step(params, *batch) -> loss`` with
``cfx.value_and_grad`` and records the whole computation with ``make_fx`` on fake tensors, so the
graph holds every aten op of the forward, the backward autograd derives from it, and the loss and
gradients as outputs. Each ``Op`` carries its output's shape and dtype, its FLOPs (PyTorch's
``flop_counter`` formulas: matmuls, convolutions, attention) and bytes, and its phase: ``backward``
for the ops that depend on the gradient's seed (autograd's ``ones_like`` of the loss), ``forward``
for the rest. Params and batch tensors are the graph's inputs, each with its pytree path.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import flop_registry

from cfx._src.core import tree as tree_util
from cfx._src.transforms.autodiff import value_and_grad


@dataclasses.dataclass(frozen=True)
class Op:
    index: int
    name: str                      # the fx node's name
    target: str                    # "aten.mm.default", "param", "input", "output"
    inputs: tuple[int, ...]        # the ops whose outputs it reads
    shape: tuple[int, ...] | None  # its (first) output's shape; None for non-tensors
    dtype: torch.dtype | None
    flops: int
    bytes: int                     # its outputs' bytes
    phase: str                     # "forward" | "backward" | "input"
    path: str | None = None        # params' and batch tensors' pytree path


@dataclasses.dataclass(frozen=True)
class Graph:
    ops: tuple[Op, ...]
    params: tuple[int, ...]        # the ops that are param inputs, in the params tree's leaf order
    batch: tuple[int, ...]         # ... batch inputs
    outputs: tuple[int, ...]       # the loss, then each param's gradient
    module: Any                    # the traced torch.fx.GraphModule

    def flops(self, phase: str | None = None) -> int:
        return sum(op.flops for op in self.ops if phase in (None, op.phase))

    def itemsize(self, i: int) -> int:
        """Bytes per element of op ``i``'s output (4 for a non-tensor)."""
        dtype = self.ops[i].dtype
        return dtype.itemsize if dtype is not None else 4

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.ops]
        for op in self.ops:
            for i in op.inputs:
                out[i].append(op.index)
        return out


def trace(step: Callable[..., torch.Tensor], params: Any, *batch: Any) -> Graph:
    """``step``'s forward and backward as a ``Graph`` (module doc). ``params`` and ``batch`` may be
    real tensors or ``ShapeDtype``-like leaves; only their shapes and dtypes are read."""
    p_items, p_def = tree_util.flatten_with_path(params)
    b_items, b_def = tree_util.flatten_with_path(batch)
    n_p = len(p_items)

    def flat(*leaves):
        p = tree_util.unflatten(p_def, list(leaves[:n_p]))
        b = tree_util.unflatten(b_def, list(leaves[n_p:]))
        loss, grads = value_and_grad(lambda q: step(q, *b))(p)
        return (loss, *tree_util.leaves(grads))

    # fake CPU tensors (no storage): the ops traced are the ones the CPU would run (a meta
    # tensor would take other kernels' paths, e.g. attention's math fallback)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        examples = [mode.from_tensor(x.detach()) if isinstance(x, torch.Tensor)
                    else torch.empty(tuple(x.shape), dtype=x.dtype) for _, x in p_items + b_items]
        gm = make_fx(flat, tracing_mode="real")(*examples)
    return _profile(gm, [p for p, _ in p_items], [p for p, _ in b_items])


def _profile(gm, p_paths: list[str], b_paths: list[str]) -> Graph:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    paths = dict(zip(placeholders, [f"params.{p}" for p in p_paths] + [f"batch.{p}" for p in b_paths]))
    seeds = {n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.ones_like.default}
    backward: set = set()
    ops = []
    for n in nodes:
        inputs = tuple(index[a] for a in n.all_input_nodes)
        if n in seeds or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        val = n.meta.get("val")
        first = val[0] if isinstance(val, (tuple, list)) and val else val
        tensors = [v for v in tree_util.leaves(val) if isinstance(v, torch.Tensor)] if val is not None else []
        if n.op == "placeholder":
            target, phase = ("param" if n in list(paths)[:len(p_paths)] else "input"), "input"
        elif n.op == "output":
            target, phase = "output", "backward"
        else:
            target, phase = str(n.target), ("backward" if n in backward else "forward")
        ops.append(Op(index[n], n.name, target, inputs,
                      tuple(first.shape) if isinstance(first, torch.Tensor) else None,
                      first.dtype if isinstance(first, torch.Tensor) else None,
                      _flops(n), sum(math.prod(t.shape) * t.element_size() for t in tensors), phase, paths.get(n)))
    out_node = nodes[-1]
    outputs = tuple(index[a] for a in out_node.args[0])
    return Graph(tuple(ops), tuple(index[n] for n in placeholders[:len(p_paths)]),
                 tuple(index[n] for n in placeholders[len(p_paths):]), outputs, gm)


_aten = torch.ops.aten
# ops whose formula PyTorch registers only under their CUDA twin (same leading arguments)
_TWINS = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
          _aten._scaled_dot_product_flash_attention_for_cpu_backward:
              _aten._scaled_dot_product_flash_attention_backward}


def _flops(n) -> int:
    """PyTorch's FLOP formula for the node's op (0 where it has none: elementwise, views)."""
    if n.op != "call_function" or not hasattr(n.target, "_overloadpacket"):
        return 0
    packet = n.target._overloadpacket
    formula = flop_registry.get(_TWINS.get(packet, packet))
    if formula is None:
        return 0
    args, kwargs = tree_util.map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
                                 (n.args, n.kwargs), is_leaf=lambda a: isinstance(a, torch.fx.Node))
    return int(formula(*args, **kwargs, out_val=n.meta.get("val")))
