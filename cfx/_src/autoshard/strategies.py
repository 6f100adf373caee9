"""Sharding strategies per aten op over a named mesh (GSPMD / Alpa's intra-operator space; specs
and ``Strategy`` are ``specs.py``'s):

* inputs (params, batch tensors): any spec of their shape;
* ``mm`` / ``addmm``: each mesh axis splits M (rows), N (columns), K (the contraction, partial
  sums) or nothing -- data parallelism, Megatron's column and row splits, and their mixes;
* elementwise ops (and their backward twins): the output's spec, each input aligned to it from
  the right (a broadcast dimension of size 1 stays whole);
* ``t`` / ``transpose`` / ``permute``: the input's spec permuted; ``view`` / ``reshape``: a split
  moves with the first dimension of its group of merged or split dimensions; ``expand``: the
  expanded dimensions stay whole;
* ``sum`` over dimensions: a split reduced dimension makes the output partial;
* ``getitem`` of an op returning several tensors: the output its op's strategy gives, one
  strategy per strategy of that op (``Strategy.source``);
* a transformer's layers' ops: ``strategies_nn``;
* anything else: replicated (every input whole, the op on every rank), with a warning naming the op
  (none for an op of no tensor inputs, e.g. ``arange``: a constant every rank makes whole).
"""
from __future__ import annotations

import itertools
import math
import operator
import warnings

import torch

from cfx._src.autoshard.specs import Strategy, entries, shape_of, spec, specs_of
from cfx._src.autoshard.strategies_nn import layer_strategies
from cfx._src.mesh.spec import P

aten = torch.ops.aten

ELEMENTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.relu.default,
               aten.gelu.default, aten.gelu_backward.default, aten.threshold_backward.default, aten.silu.default,
               aten.tanh.default, aten.neg.default, aten.detach.default, aten.clone.default, aten.alias.default,
               aten.pow.Tensor_Scalar, aten.ones_like.default, aten.zeros_like.default, aten.le.Scalar,
               aten.where.self, aten.sigmoid.default, aten.exp.default, aten.copy.default, aten.mul.Scalar,
               aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsqrt.default, aten.sqrt.default,
               aten.silu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
               aten.reciprocal.default, aten.cos.default, aten.sin.default, aten.pow.Scalar, aten.pow.Tensor_Tensor,
               aten._to_copy.default, aten.erf.default, aten.masked_fill.Scalar, aten.eq.Scalar, aten.ne.Scalar,
               aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.abs.default, aten.log.default, aten.fill.Scalar}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
# ops that return a view of their input (no bytes written: the search charges them no memory time)
ALIASING = VIEWS | TRANSPOSES | {aten.expand.default, aten.detach.default, aten.alias.default, aten.unsqueeze.default,
                                 aten.squeeze.dim, aten.select.int, aten.slice.Tensor, aten.split.Tensor,
                                 operator.getitem}


def strategies(node: torch.fx.Node, mesh_shape: dict[str, int]) -> list[Strategy]:
    """The strategies of ``node`` (module doc); at least one (replicated)."""
    shape = shape_of(node)
    tensors = list(node.all_input_nodes)
    if node.op == "placeholder":
        return [Strategy(s, ()) for s in specs_of(shape, mesh_shape)] if shape is not None else [Strategy(P(), ())]
    target = node.target
    found: list[Strategy] = []
    if target in (aten.mm.default, aten.addmm.default):
        found = _matmul(node, mesh_shape)
    elif target in ELEMENTWISE and shape is not None:
        found = [Strategy(s, tuple(_aligned(s, shape, shape_of(t)) for t in tensors)) for s in specs_of(shape, mesh_shape)]
        found = [f for f in found if None not in f.ins or all(shape_of(t) is None for t in tensors)]
    elif target in TRANSPOSES:
        found = _transpose(node, shape, mesh_shape)
    elif target in VIEWS:
        found = _view(node, shape, mesh_shape)
    elif target is aten.expand.default:
        src = shape_of(tensors[0])
        lead = len(shape) - len(src)
        found = [Strategy(s, (_aligned(s, shape, src),)) for s in specs_of(shape, mesh_shape)
                 if all(not a or (d >= lead and src[d - lead] == shape[d]) for d, a in enumerate(entries(s, len(shape))))]
    elif target in (aten.sum.dim_IntList, aten.sum.default, aten.mean.default, aten.mean.dim):
        found = _sum(node, mesh_shape)
    elif target is operator.getitem:
        found = _getitem(node, mesh_shape)
    else:
        found = layer_strategies(node, mesh_shape)
    if not found:
        if node.op == "call_function" and target is not operator.getitem and shape is not None and tensors:
            warnings.warn(f"cfx.autoshard: no sharding strategies for {target} ({node.name}); it runs replicated.",
                          stacklevel=2)
        found = [Strategy(P(), tuple(P() if shape_of(t) is not None else None for t in tensors))]
    return found


def _aligned(out: P, shape: tuple, src: tuple | None) -> P | None:
    """An input of shape ``src`` broadcast to ``shape`` read in ``out``'s layout (right-aligned)."""
    if src is None:
        return None
    e = entries(out, len(shape))
    lead = len(shape) - len(src)
    return spec([e[lead + d] if src[d] == shape[lead + d] else () for d in range(len(src))])


def _matmul(node, mesh_shape) -> list[Strategy]:
    bias = node.target is aten.addmm.default
    a, b = node.args[1:3] if bias else node.args[:2]
    (M, K), (_, N) = shape_of(a), shape_of(b)
    out = []
    size = {"M": M, "N": N, "K": K}
    for roles in itertools.product((None, "M", "N", "K"), repeat=len(mesh_shape)):
        pick = {r: tuple(ax for ax, q in zip(mesh_shape, roles) if q == r) for r in "MNK"}
        if any(size[r] % math.prod(mesh_shape[a] for a in axes) for r, axes in pick.items()):
            continue
        m, n, k = pick["M"], pick["N"], pick["K"]
        ins = (spec([m, k]), spec([k, n]))
        if bias:
            ins = (spec([n]) if len(shape_of(node.args[0])) == 1 else spec([(), n]),) + ins
        out.append(Strategy(spec([m, n]), ins, div=math.prod(mesh_shape[a] for a in m + n + k), partial=k))
    return out


def _transpose(node, shape, mesh_shape) -> list[Strategy]:
    ndim = len(shape)
    if node.target is aten.t.default:
        perm = [1, 0] if ndim == 2 else [0]
    elif node.target is aten.transpose.int:
        i, j = (d % ndim for d in node.args[1:3])
        perm = list(range(ndim))
        perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = [d % ndim for d in node.args[1]]
    out = []
    for s in specs_of(shape, mesh_shape):
        e = entries(s, ndim)
        src: list[tuple[str, ...]] = [()] * ndim
        for d, p in enumerate(perm):
            src[p] = e[d]
        out.append(Strategy(s, (spec(src),)))
    return out


def _groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pairs (source dims, destination dims) of equal products, in order (a view's dim mapping)."""
    out, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif pj < pi and j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return None
        out.append((gi, gj))
    return out


def _view(node, shape, mesh_shape) -> list[Strategy]:
    src = shape_of(node.all_input_nodes[0])
    groups = _groups(src, shape)
    if groups is None:
        return []
    out = []
    for s in specs_of(shape, mesh_shape):
        e = entries(s, len(shape))
        ins: list[tuple[str, ...]] = [()] * len(src)
        ok = True
        for gi, gj in groups:
            split = [d for d in gj if e[d]]
            if not split:
                continue
            if split != gj[:1] or not gi or src[gi[0]] % math.prod(mesh_shape[a] for a in e[gj[0]]):
                ok = False  # only the first (major) dimension of a group carries a split across a view
                break
            ins[gi[0]] = e[gj[0]]
        if ok:
            out.append(Strategy(s, (spec(ins),)))
    return out


def _sum(node, mesh_shape) -> list[Strategy]:
    src = shape_of(node.args[0])
    whole = node.target in (aten.sum.default, aten.mean.default) or not node.args[1]
    dims = set(range(len(src))) if whole else {d % len(src) for d in node.args[1]}
    keep = not whole and len(node.args) > 2 and node.args[2]
    out = []
    for s in specs_of(src, mesh_shape):
        e = entries(s, len(src))
        partial = tuple(a for d in sorted(dims) for a in e[d])
        kept = [() if d in dims else e[d] for d in range(len(src)) if keep or d not in dims]
        out.append(Strategy(spec(kept), (s,), div=math.prod(mesh_shape[a] for d in e for a in d), partial=partial))
    return out


def _getitem(node, mesh_shape) -> list[Strategy]:
    parent, i = node.args
    found = []
    for j, st in enumerate(strategies(parent, mesh_shape)):
        outs = st.outs or (st.out,)
        partial = dict(st.reduces).get(i, ())
        found.append(Strategy(outs[i] if i < len(outs) else P(), (None,), partial=partial, source=j))
    return found
