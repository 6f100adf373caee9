"""Strategies of the ops a transformer's layers lower to (``strategies`` covers the generic ones):

* ``native_layer_norm`` (and its backward): any split of the dimensions before the normalised
  ones; the weight and bias whole, their gradients partial over the axes splitting the rows;
* attention (SDPA's flash ops, forward and backward): ``(B, H, T, D)`` split over the batch and
  heads only (a sequence split is ``cfx.parallel``'s ring or Ulysses, not a layout);
* ``embedding``: the ids' layout carries to the rows; the table whole, split along the embedding
  width (the output follows), or along the vocabulary (each rank's rows, a partial sum); its
  backward is partial over the axes splitting the ids;
* ``log_softmax`` / ``nll_loss`` (and their backwards): the class dimension whole, the rows split;
  the loss a partial sum over the row axes;
* ``slice`` / ``select`` / ``split`` / ``cat`` (and their backwards): the dimension they cut or
  join whole; ``unsqueeze`` / ``squeeze``: the other dimensions' splits carried over.
"""
from __future__ import annotations

import torch

from cfx._src.autoshard.specs import Strategy, entries, shape_of, spec, specs_of
from cfx._src.mesh.spec import P

aten = torch.ops.aten
SDPA = (aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default)
SDPA_BACKWARD = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                 aten._scaled_dot_product_flash_attention_backward.default)


def layer_strategies(node: torch.fx.Node, mesh_shape: dict[str, int]) -> list[Strategy]:
    """The strategies of ``node`` if its op is one of a layer's (module doc), else ``[]``."""
    rule = _RULES.get(node.target)
    return rule(node, list(node.all_input_nodes), mesh_shape) if rule is not None else []


def _layer_norm(node, tensors, mesh_shape) -> list[Strategy]:
    x, k = shape_of(node.args[0]), len(node.args[1])
    return [Strategy(s, (s,) + tuple(P() for _ in tensors[1:]), div=_n(s, x, mesh_shape), outs=(s, s, s))
            for s in _leading(x, k, mesh_shape)]


def _layer_norm_backward(node, tensors, mesh_shape) -> list[Strategy]:
    x, k = shape_of(node.args[1]), len(node.args[2])
    out = []
    for s in _leading(x, k, mesh_shape):
        rows = tuple(a for d in entries(s, len(x) - k) for a in d)
        ins = tuple(s if shape_of(n) is not None and len(shape_of(n)) == len(x) else P() for n in tensors)
        out.append(Strategy(s, ins, div=_n(s, x, mesh_shape), outs=(s, P(), P()),
                            reduces=((1, rows), (2, rows)) if rows else ()))
    return out


def _attention(node, tensors, mesh_shape) -> list[Strategy]:
    forward = node.target in SDPA
    q = shape_of(tensors[0] if forward else node.args[1])
    out = []
    for s in _leading(q, 2, mesh_shape):  # (B, H) split; T and D whole
        lse = spec(entries(s, 3))
        ins = tuple(s if len(shape_of(n)) == 4 else lse for n in tensors)
        out.append(Strategy(s, ins, div=_n(s, q, mesh_shape), outs=(s, lse) if forward else (s, s, s)))
    return out


def _embedding(node, tensors, mesh_shape) -> list[Strategy]:
    (V, C), ids = shape_of(node.args[0]), shape_of(node.args[1])
    out = []
    for s in specs_of(ids, mesh_shape):
        used = {a for d in entries(s, len(ids)) for a in d}
        free = [a for a in mesh_shape if a not in used]
        out.append(Strategy(spec(entries(s, len(ids))), (P(), s), div=_n(s, ids, mesh_shape)))
        for a in free:
            if C % mesh_shape[a] == 0:  # the width split: each rank its columns of every row
                out.append(Strategy(spec(entries(s, len(ids)) + [(a,)]), (P(None, a), s), div=_n(s, ids, mesh_shape)))
            if V % mesh_shape[a] == 0:  # the vocabulary split: each rank its rows, the lookups summed
                out.append(Strategy(spec(entries(s, len(ids))), (P(a), s), div=_n(s, ids, mesh_shape), partial=(a,)))
    return out


def _embedding_backward(node, tensors, mesh_shape) -> list[Strategy]:
    grad = shape_of(node.args[0])
    out = []
    for s in specs_of(grad, mesh_shape):
        e = entries(s, len(grad))
        rows = tuple(a for d in e[:-1] for a in d)
        out.append(Strategy(spec([(), e[-1]]), (s, spec(e[:-1])), partial=rows))
    return out


def _softmax(node, tensors, mesh_shape) -> list[Strategy]:
    backward = node.target in (aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
    x = shape_of(node.args[0])
    dim = node.args[2 if backward else 1] % len(x)
    return [Strategy(s, (s, s) if backward else (s,)) for s in _whole_along(x, dim, mesh_shape)]


def _nll_loss(node, tensors, mesh_shape) -> list[Strategy]:
    x = shape_of(node.args[0])
    out = []
    for s in _leading(x, 1, mesh_shape):
        row_spec = spec(entries(s, len(x))[:-1])
        rows = tuple(a for d in entries(s, len(x))[:-1] for a in d)
        ins = tuple(s if n is node.args[0] else row_spec if shape_of(n) == x[:-1] else P() for n in tensors)
        if node.args[3] == 0:  # reduction="none": a loss per row, laid out like the rows
            out.append(Strategy(row_spec, ins, outs=(row_spec, P()), reduces=((1, rows),) if rows else ()))
        else:  # a mean or sum over the rows: partial sums (lowering divides by the global weight)
            out.append(Strategy(P(), ins, outs=(P(), P()), reduces=((0, rows), (1, rows)) if rows else ()))
    return out


def _nll_loss_backward(node, tensors, mesh_shape) -> list[Strategy]:
    x = shape_of(node.args[1])
    out = []
    for s in _leading(x, 1, mesh_shape):
        rows = spec(entries(s, len(x))[:-1])
        out.append(Strategy(s, tuple(s if shape_of(n) == x else rows if shape_of(n) == x[:-1] else P() for n in tensors)))
    return out


def _slice(node, tensors, mesh_shape) -> list[Strategy]:
    x = shape_of(node)
    dim = (node.args[1] if node.target is aten.slice.Tensor else node.args[2]) % len(x)
    return [Strategy(s, (s,)) for s in _whole_along(x, dim, mesh_shape)]


def _select(node, tensors, mesh_shape) -> list[Strategy]:
    # select (x, dim, index) drops the dimension; its backward (grad, input_sizes, dim, index) adds it back
    backward = node.target is aten.select_backward.default
    x = shape_of(node if backward else node.args[0])
    dim = node.args[2 if backward else 1] % len(x)
    out = []
    for s in _whole_along(x, dim, mesh_shape):
        e = entries(s, len(x))
        dropped = spec(e[:dim] + e[dim + 1:])
        out.append(Strategy(s, (dropped,)) if backward else Strategy(dropped, (s,)))
    return out


def _split(node, tensors, mesh_shape) -> list[Strategy]:
    x = shape_of(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else 0) % len(x)
    n = len(node.meta["val"])
    return [Strategy(s, (s,), outs=(s,) * n) for s in _whole_along(x, dim, mesh_shape)]


def _cat(node, tensors, mesh_shape) -> list[Strategy]:
    x = shape_of(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(x)
    if not all(shape_of(n) is not None and len(shape_of(n)) == len(x) for n in tensors):
        return []
    return [Strategy(s, tuple(s for _ in tensors)) for s in _whole_along(x, dim, mesh_shape)]


def _unsqueeze_squeeze(node, tensors, mesh_shape) -> list[Strategy]:
    unsqueeze = node.target is aten.unsqueeze.default
    x, y = shape_of(node.args[0]), shape_of(node)
    dim = node.args[1] % len(y if unsqueeze else x)
    out = []
    for s in specs_of(x, mesh_shape):
        e = entries(s, len(x))
        if unsqueeze:
            out.append(Strategy(spec(e[:dim] + [()] + e[dim:]), (s,)))
        elif x[dim] != 1:  # squeezing a dimension that is not 1 returns the input
            out.append(Strategy(s, (s,)))
        elif not e[dim]:
            out.append(Strategy(spec(e[:dim] + e[dim + 1:]), (s,)))
    return out


_RULES = {
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    **{t: _attention for t in SDPA + SDPA_BACKWARD},
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    **{t: _softmax for t in (aten._log_softmax.default, aten._softmax.default,
                             aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)},
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.slice.Tensor: _slice,
    aten.slice_backward.default: _slice,
    aten.select.int: _select,
    aten.select_backward.default: _select,
    aten.split.Tensor: _split,
    aten.cat.default: _cat,
    aten.unsqueeze.default: _unsqueeze_squeeze,
    aten.squeeze.dim: _unsqueeze_squeeze,
}


def _whole_along(shape: tuple, dim: int, mesh_shape: dict[str, int]) -> list[P]:
    """Specs of ``shape`` that keep dimension ``dim`` whole."""
    return [s for s in specs_of(shape, mesh_shape) if not entries(s, len(shape))[dim]]


def _n(s: P, shape: tuple, mesh_shape: dict[str, int]) -> int:
    n = 1
    for d in entries(s, len(shape)):
        for a in d:
            n *= mesh_shape[a]
    return n


def _leading(shape: tuple, k: int, mesh_shape: dict[str, int]) -> list[P]:
    """Specs of ``shape`` splitting only the dimensions before its last ``k``."""
    return [s for s in specs_of(shape, mesh_shape) if not any(entries(s, len(shape))[len(shape) - k:])]
