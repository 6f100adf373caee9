"""Weight-only int8 quantisation of a params pytree: ``quantize(params, "int8")``.

Each Linear weight ``w`` ``(in, out)`` becomes a ``QuantizedWeight(q, scale)``: ``q`` int8
``(in, out)`` and ``scale`` fp32 ``(out,)`` with ``w ~= q * scale`` (symmetric absmax per output
column). ``QuantizedWeight`` is a NamedTuple, hence a pytree node, so ``cfx.tree`` functions see
its two tensors (``...q.w.q`` and ``...q.w.scale``) and ``tree_bytes`` counts the int8 bytes.
``cfx.nn.Linear.apply`` runs ``cfx_kernels.int8_matmul`` when its ``w`` is one, and the models'
params checks accept one wherever ``init`` has a weight, so ``model.apply(quantize(params,
"int8"), tokens)`` just works. Quantised params are for inference: the int8 weights get no
gradients.

Which leaves are Linear weights: a dict whose keys are ``{"w"}`` or ``{"w", "b"}`` (the params
of ``cfx.nn.Linear``) with ``w`` a 2-D floating tensor of at least ``min_size`` elements.
``cfx.nn.Embedding`` params (``{"w"}``, ``(vocab, C)``) look the same, so subtrees under the keys
in ``skip`` (default: GPT-2's ``wte``/``wpe`` and Llama's ``embed``, which the tied LM head
reads too) are left alone.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from cfx._src import tree as tree_util
from cfx_kernels.int8_matmul import quantize_weight

MODES = ("int8",)
EMBEDDING_KEYS = ("wte", "wpe", "embed")


class QuantizedWeight(NamedTuple):
    """An int8 ``(in, out)`` Linear weight and its fp32 ``(out,)`` column scales."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _is_linear(node: dict, min_size: int) -> bool:
    w = node.get("w")
    return (set(node) <= {"w", "b"} and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.is_floating_point() and w.numel() >= min_size)


def quantize(params: Any, mode: str = "int8", *, min_size: int = 4096,
             skip: tuple[str, ...] = EMBEDDING_KEYS) -> Any:
    """``params`` with every Linear weight (see the module docstring) swapped for a
    ``QuantizedWeight``; everything else is shared with ``params`` unchanged."""
    if mode not in MODES:
        raise ValueError(f"cfx.quant.quantize: mode must be one of {MODES}, got {mode!r}.")
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"cfx.quant.quantize: min_size must be an int >= 0, got {min_size!r}.")

    def walk(node):
        if isinstance(node, dict):
            if _is_linear(node, min_size):
                return {**node, "w": QuantizedWeight(*quantize_weight(node["w"]))}
            return {k: v if k in skip else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if type(node) is tuple:
            return tuple(walk(v) for v in node)
        return node

    with torch.no_grad():
        return walk(params)


def dequantize(params: Any) -> Any:
    """``params`` with every ``QuantizedWeight`` replaced by its fp32 ``q * scale``."""
    return tree_util.map(lambda x: x.dequantize() if is_quantized(x) else x, params,
                         is_leaf=is_quantized)


def quantized_as_leaves(params: Any) -> Any:
    """``params`` with each ``QuantizedWeight`` node standing as one leaf (its ``q``), so the
    tree has the structure of the unquantised params (what the models' params checks compare)."""
    return tree_util.map(lambda x: x.q if is_quantized(x) else x, params, is_leaf=is_quantized)
