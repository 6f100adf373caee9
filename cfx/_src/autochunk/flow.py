"""Which dimension of which tensor a chunk of a region's output comes from (AutoChunk's "flow").

A *region* computes one output ``o`` of an aten graph chunk by chunk along one of its dims. Walking
back from ``o``, each op says, for the dim (and unit) of its output being chunked, which dim of
each input the chunk comes from (``Chunk``), or that the input is needed whole (``None``: a
broadcast operand, a weight, the bias every row shares). An op that reduces, normalises or
indexes along the chunked dim cannot be chunked there (``rule`` returns ``FAIL``); its output is
then computed whole, before the region, and the region slices it.

``Chunk(dim, unit)``: chunk ``i`` of ``n`` covers ``[i * unit, (i + 1) * unit)`` along ``dim``;
units other than 1 come from reshapes that merge the chunked dim with inner ones (the einsum
lowering's ``(i, c) -> i * c``).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import Node

aten = torch.ops.aten
FAIL = object()


@dataclasses.dataclass(frozen=True)
class Chunk:
    dim: int
    unit: int = 1


def shape_of(x: Any) -> tuple[int, ...] | None:
    """A node's output shape (a multi-output op's first output), None for non-tensors."""
    val = x.meta.get("val") if isinstance(x, Node) else None
    if isinstance(val, (tuple, list)) and val:
        val = val[0]
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default,
    aten.rsqrt.default, aten.reciprocal.default, aten.abs.default, aten.sigmoid.default, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.tanh.default, aten.erf.default, aten.clone.default,
    aten._to_copy.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar,
    aten.le.Scalar, aten.eq.Scalar, aten.ne.Scalar, aten.gt.Tensor, aten.lt.Tensor, aten.ge.Tensor,
    aten.le.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.maximum.default, aten.minimum.default,
    aten.clamp.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}


def rule(node: Node, c: Chunk) -> dict | object:
    """``{input node: Chunk | None}`` for a chunk ``c`` of ``node``'s output, or ``FAIL``."""
    out = shape_of(node)
    t, args = node.target, node.args
    if node.op != "call_function":
        return FAIL
    if t is operator.getitem:  # an element of a multi-output op: same leading dims
        return {args[0]: c}
    if out is None or c.dim >= len(out):
        return FAIL
    if t in _ELEMENTWISE:
        return _broadcast(node, c, [a for a in list(args) + list(node.kwargs.values()) if isinstance(a, Node)])
    if t in _VIEWS:
        return _view(args[0], out, c)
    if t is aten.transpose.int:
        a, b = (d % len(out) for d in args[1:3])
        return {args[0]: Chunk({a: b, b: a}.get(c.dim, c.dim), c.unit)}
    if t is aten.permute.default:
        return {args[0]: Chunk(list(args[1])[c.dim] % len(out), c.unit)}
    if t is aten.t.default:
        return {args[0]: Chunk(1 - c.dim, c.unit)} if len(out) == 2 else {args[0]: c}
    if t is aten.unsqueeze.default:
        d = args[1] % len(out)
        return FAIL if c.dim == d else {args[0]: Chunk(c.dim - (c.dim > d), c.unit)}
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        return _squeeze(node, c)
    if t is aten.expand.default:
        return _broadcast(node, c, [args[0]])
    if t is aten.mm.default:
        return {args[0]: c if c.dim == 0 else None, args[1]: c if c.dim == 1 else None}
    if t is aten.addmm.default:
        bias = args[0]
        return {**_broadcast(node, c, [bias]), args[1]: c if c.dim == 0 else None, args[2]: c if c.dim == 1 else None}
    if t is aten.bmm.default:
        return {args[0]: c if c.dim in (0, 1) else None, args[1]: c if c.dim in (0, 2) else None}
    if t is aten._softmax.default or t is aten._log_softmax.default:
        return FAIL if args[1] % len(out) == c.dim else {args[0]: c}
    if t is aten.native_layer_norm.default:
        x = shape_of(args[0])
        if c.dim >= len(x) - len(args[1]):
            return FAIL
        return {args[0]: c, **{a: None for a in args[2:4] if isinstance(a, Node)}}
    if t in _REDUCTIONS:
        return _reduction(node, c)
    if t is aten.slice.Tensor:
        return FAIL if (args[1] if len(args) > 1 else 0) % len(out) == c.dim else {args[0]: c}
    if t is aten.select.int:
        d = args[1] % (len(out) + 1)
        return {args[0]: Chunk(c.dim + (c.dim >= d), c.unit)}
    if t is aten.cat.default:
        d = (args[1] if len(args) > 1 else 0) % len(out)
        return FAIL if d == c.dim else {x: c for x in args[0]}
    return FAIL


def _broadcast(node: Node, c: Chunk, inputs: list) -> dict:
    out = shape_of(node)
    need = {}
    for x in inputs:
        s = shape_of(x)
        if s is None:
            continue
        d = c.dim - (len(out) - len(s))
        need[x] = None if d < 0 or s[d] != out[c.dim] else Chunk(d, c.unit)
    return need


def _view(x: Node, out: tuple, c: Chunk) -> dict | object:
    """Reshapes: ``c.dim`` must lead its group of merged / split dims (after size-1 dims), so a
    chunk of it is a contiguous run of the group's elements, which is a chunk of the input
    group's leading dim (with its own unit)."""
    src = shape_of(x)
    groups = _groups(src, out)
    if groups is None:
        return FAIL
    for ins, outs in groups:
        if c.dim not in outs:
            continue
        lead = [d for d in outs if out[d] != 1]
        if not lead or lead[0] != c.dim:
            return FAIL
        in_lead = [d for d in ins if src[d] != 1]
        if not in_lead:
            return FAIL
        run = c.unit * math.prod(out[d] for d in outs if d > c.dim)      # elements per chunk index
        inner = math.prod(src[d] for d in ins if d > in_lead[0])
        if run % inner:
            return FAIL
        return {x: Chunk(in_lead[0], run // inner)}
    return FAIL


def _groups(a: tuple, b: tuple) -> list | None:
    """Pairs ``(dims of a, dims of b)`` with equal products, covering both shapes in order."""
    i = j = 0
    out = []
    while i < len(a) or j < len(b):
        ia, jb = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + (i < len(a)), j + (j < len(b))
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                ia.append(i)
                i += 1
            elif pb < pa and j < len(b):
                pb *= b[j]
                jb.append(j)
                j += 1
            else:
                return None
        out.append((ia, jb))
    return out


def _squeeze(node: Node, c: Chunk) -> dict:
    x = node.args[0]
    src = shape_of(x)
    if node.target is aten.squeeze.default:
        gone = [d for d, n in enumerate(src) if n == 1]
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        gone = [d % len(src) for d in dims if src[d % len(src)] == 1]
    kept = [d for d in range(len(src)) if d not in gone]
    return {x: Chunk(kept[c.dim], c.unit)}


def _reduction(node: Node, c: Chunk) -> dict | object:
    x = node.args[0]
    src = shape_of(x)
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(len(src)))
    dims = {d % len(src) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if keep:
        return FAIL if c.dim in dims else {x: c}
    kept = [d for d in range(len(src)) if d not in dims]
    return {x: Chunk(kept[c.dim], c.unit)}


@dataclasses.dataclass
class Region:
    """``output`` computed in ``n`` chunk indices along ``chunk``: ``members`` (in graph order, the
    output last) run per chunk on ``inputs`` (external nodes, each sliced by its Chunk or whole)."""

    output: Node
    chunk: Chunk
    n: int
    members: list
    inputs: list            # [(node, Chunk | None)], one entry per distinct slicing of a node
    needs: dict             # member -> {input node: Chunk | None}


def flow(order: list, index: dict, output: Node, chunk: Chunk) -> Region | None:
    """The largest region ending at ``output`` chunked along ``chunk`` (module doc): a node joins
    when every user is a member wanting the same chunk of it and its own rule holds."""
    shape = shape_of(output)
    if shape is None or shape[chunk.dim] % chunk.unit or shape[chunk.dim] // chunk.unit < 2:
        return None
    n = shape[chunk.dim] // chunk.unit
    want: dict[Node, Any] = {output: chunk}
    needs: dict[Node, dict] = {}
    members: set[Node] = set()
    lowest = index[output]  # the earliest node any member wants: nothing before it can join
    for i in range(index[output], -1, -1):
        if i < lowest:
            break
        node = order[i]
        if node not in want:
            continue
        c = want[node]
        if node is not output:
            asks = [needs[u].get(node, FAIL) if u in members else FAIL for u in node.users]
            if any(a is FAIL or a is None or a != c for a in asks):
                continue
        s = shape_of(node)
        if node.target is not operator.getitem and (s is None or s[c.dim] != n * c.unit):
            continue
        got = rule(node, c)
        if got is FAIL:
            continue
        for x in node.all_input_nodes:  # what the rule does not slice is used whole
            got.setdefault(x, None)
        members.add(node)
        needs[node] = got
        for x, cx in got.items():
            if cx is not None and isinstance(x, Node) and x.op == "call_function":
                want.setdefault(x, cx)
                lowest = min(lowest, index[x])
    if output not in members:
        return None
    ordered = sorted(members, key=index.__getitem__)
    inputs, seen = [], set()
    for node in ordered:
        for x, cx in needs[node].items():
            if isinstance(x, Node) and x not in members and (x, cx) not in seen:
                seen.add((x, cx))
                inputs.append((x, cx))
    return Region(output, chunk, n, ordered, inputs, needs)
