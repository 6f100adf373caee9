"""Weight-only int8 quantisation of a params pytree: ``quantize(params, "int8")``.

Each Linear or Conv2d weight becomes a ``QuantizedWeight(q, scale)`` with ``w ~= q * scale``
(symmetric absmax per output channel, ``q`` in [-127, 127]):

* a Linear weight ``(in, out)``: ``q`` int8 ``(in, out)``, ``scale`` fp32 ``(out,)`` (one per
  column); ``cfx.nn.Linear.apply`` runs ``cfx_kernels.int8_matmul`` on it;
* a Conv2d weight ``(out, in, kh, kw)``: ``q`` int8 ``(out, in, kh, kw)``, ``scale`` fp32
  ``(out, 1, 1, 1)`` (one per output channel, shaped to broadcast against ``q``);
  ``cfx.nn.Conv2d.apply`` dequantises it into the input's dtype for the call (only the int8
  tensor is kept) and runs ``F.conv2d``.

``QuantizedWeight`` is a NamedTuple, hence a pytree node, so ``cfx.tree`` functions see its two
tensors (``...q.w.q`` and ``...q.w.scale``) and ``cfx.tree.nbytes`` counts the int8 bytes. The models'
params checks accept one wherever ``init`` has a weight, so ``model.apply(quantize(params,
"int8"), tokens)`` just works. Quantised params are for inference: the int8 weights get no
gradients.

Which leaves are weights: a dict whose keys are ``{"w"}`` or ``{"w", "b"}`` (the params of
``cfx.nn.Linear`` and ``cfx.nn.Conv2d``) with ``w`` a floating tensor of at least ``min_size``
elements, 2-D for ``"linear"`` and 4-D for ``"conv"`` (``kinds`` picks which are quantised).
``cfx.nn.Embedding`` params (``{"w"}``, ``(vocab, C)``) look like a Linear's; the model's logical axes
tell them apart: with ``axes=model.axes()``, a lookup table (a weight whose first logical axis is
``"vocab"`` or ``"positions"``: token and position embeddings, and so a tied LM head) stays in floating
point, its rows read exactly. Without ``axes`` nothing tells a table from a bias-free Linear weight
(both ``{"w"}``), so only the unambiguous weights are quantised: Linear weights with a bias and
convolutions. Subtrees under the keys in ``skip`` are left alone either way.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from cfx._src.core import tree as tree_util
from cfx_kernels.int8_matmul import quantize_weight

MODES = ("int8",)
KINDS = {"linear": 2, "conv": 4}  # a kind of weight -> the number of dims its ``w`` has
TABLE_AXES = ("vocab", "positions")  # a weight whose rows are looked up: its first logical axis


class QuantizedWeight(NamedTuple):
    """An int8 weight ``q`` and its fp32 per-output-channel ``scale``, broadcastable to ``q``:
    a Linear's ``(in, out)`` with ``(out,)``, or a Conv2d's ``(out, in, kh, kw)`` with
    ``(out, 1, 1, 1)``."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """``q * scale`` in fp32, the weight the int8 one stands for."""
        return self.q.float() * self.scale.float()


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _is_weight(node: dict, min_size: int, ndims: tuple[int, ...]) -> bool:
    """Whether ``node`` is a Linear / Conv2d params dict whose ``w`` (of ``ndims`` dims) gets quantised."""
    w = node.get("w")
    return (set(node) <= {"w", "b"} and isinstance(w, torch.Tensor) and w.dim() in ndims
            and w.is_floating_point() and w.numel() >= min_size)


def _quantize_conv(w: torch.Tensor) -> QuantizedWeight:
    """A ``(out, in, kh, kw)`` conv weight, quantised per output channel by the Linear quantizer
    (one rounding rule) on its ``(in * kh * kw, out)`` view."""
    out = w.shape[0]
    q, scale = quantize_weight(w.reshape(out, -1).t())  # (in kh kw, out), (out,)
    return QuantizedWeight(q.t().reshape(w.shape), scale.view(out, 1, 1, 1))


def _quantize(w: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(*quantize_weight(w)) if w.dim() == 2 else _quantize_conv(w)


def _check_kinds(kinds: Any) -> tuple[int, ...]:
    """The ``w`` dims of ``kinds``, or a ValueError naming the valid kinds."""
    if (isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset))
            or not all(k in KINDS for k in kinds)):
        raise ValueError(f"cfx.quant.quantize: kinds must be a tuple of names from {tuple(KINDS)}, got "
                         f"{kinds!r} (e.g. kinds=('linear',) keeps the convolutions in floating point).")
    return tuple(KINDS[k] for k in kinds)


def quantize(params: Any, mode: str = "int8", *, axes: Any = None, min_size: int = 4096,
             skip: tuple[str, ...] = (), kinds: tuple[str, ...] = tuple(KINDS)) -> Any:
    """``params`` with every Linear and Conv2d weight of ``kinds`` (``"linear"``, ``"conv"``; see
    the module docstring) swapped for a ``QuantizedWeight``; everything else is shared with
    ``params`` unchanged. ``axes`` (``model.axes()``) tells the lookup tables, which stay in floating
    point, from the bias-free Linear weights, which without it stay too (module doc);
    ``kinds=("linear",)`` leaves the convolutions alone."""
    if mode not in MODES:
        raise ValueError(f"cfx.quant.quantize: mode must be one of {MODES}, got {mode!r}.")
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"cfx.quant.quantize: min_size must be an int >= 0, got {min_size!r}.")
    ndims = _check_kinds(kinds)
    tables = _tables(params, axes)

    def chosen(node: dict, w_path: str) -> bool:
        if not _is_weight(node, min_size, ndims):
            return False
        if axes is None:  # unambiguous without axes: a Linear with its bias, a convolution
            return "b" in node or node["w"].dim() == 4
        return w_path not in tables

    def walk(node, path: str):
        at = (path + ".") if path else ""
        if isinstance(node, dict):
            if chosen(node, at + "w"):
                return {**node, "w": _quantize(node["w"])}
            return {k: v if k in skip else walk(v, f"{at}{k}") for k, v in node.items()}
        if type(node) in (list, tuple):
            return type(node)(walk(v, f"{at}{i}") for i, v in enumerate(node))
        return node

    with torch.no_grad():
        return walk(params, "")


def _tables(params: Any, axes: Any) -> set[str]:
    """The dotted paths of the lookup tables ``axes`` names (module doc); a ValueError naming
    the leaf when ``axes`` is not shaped like ``params``."""
    if axes is None:
        return set()
    where = "cfx.quant.quantize: axes (pass model.axes()) and params"
    items = tree_util.flatten_with_path(axes, is_leaf=tree_util.is_axes_leaf)[0]
    tree_util.check_same_structure(where, tree_util.map(lambda a: 0, axes, is_leaf=tree_util.is_axes_leaf),
                                   tree_util.map(lambda x: 0, quantized_as_leaves(params)))
    return {path for path, names in items if names and names[0] in TABLE_AXES}


def floating_dtype(params: Any) -> torch.dtype:
    """The dtype of ``params``' floating tensors, ``QuantizedWeight`` s aside (their scales are fp32
    whatever the rest is): what a model casts its inputs to. Only quantised weights: their scales'."""
    leaves = tree_util.leaves(params, is_leaf=is_quantized)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.dtype
    for x in leaves:
        if is_quantized(x):
            return x.scale.dtype
    raise ValueError("cfx.quant.floating_dtype: params hold no floating-point tensor or QuantizedWeight.")


def dequantize(params: Any) -> Any:
    """``params`` with every ``QuantizedWeight`` replaced by its fp32 ``q * scale``."""
    return tree_util.map(lambda x: x.dequantize() if is_quantized(x) else x, params,
                         is_leaf=is_quantized)


def quantized_as_leaves(params: Any) -> Any:
    """``params`` with each ``QuantizedWeight`` node standing as one leaf (its ``q``), so the
    tree has the structure of the unquantised params (what the models' params checks compare)."""
    return tree_util.map(lambda x: x.q if is_quantized(x) else x, params, is_leaf=is_quantized)
