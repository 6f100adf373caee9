"""``LoraWeight``: a Linear weight with a low-rank adapter beside it, standing for
``base + scale * A @ B`` without that sum ever being formed.

``cfx.lora.attach`` puts one where a ``Linear``'s ``w`` was; ``Linear.apply`` then computes
``x @ base (+ b) + scale * (dropout(x) @ A) @ B``. ``base`` is a floating ``(in, out)`` tensor of any
dtype or a ``QuantizedWeight`` (int8: QLoRA's recipe with cfx's int8); ``A`` ``(in, r)`` and ``B``
``(r, out)`` keep their own dtype (fp32 next to a bf16 base): the input is cast to it for the
adapter's path and the sum rounds once to the base path's dtype, as peft does.

``x @ w`` with a ``LoraWeight`` ``w`` is the same sum (``__rmatmul__``, without a bias): what code that
multiplies by a Linear's weight itself runs, e.g. Megatron's row-parallel output projections, where
each rank's ``x`` and ``A`` are its share of the input dim and the sum over ranks completes both terms.

A pytree node: its children are ``base``, ``A``, ``B`` and the dropout ``key`` (paths ``....w.base``,
``....w.A``, ...; ``key=None`` is an empty subtree, no dropout); ``scale`` and the dropout ``rate`` are
static. ``weight_nodes_as_leaves`` shows a params tree holding such nodes (and ``QuantizedWeight`` s)
with each weight as one leaf, the structure of the plain params that the models' checks compare.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.nn.dropout import dropout
from cfx._src.nn.fp8 import Float8Weight
from cfx._src.precision.quant import QuantizedWeight
from cfx_kernels.int8_matmul import int8_matmul


@dataclasses.dataclass(frozen=True, eq=False)
class LoraWeight:
    """``base + scale * A @ B`` (module doc); ``rate`` is the dropout on the adapter's input, drawn
    from ``key`` (None: no dropout, as in evaluation)."""

    base: Any
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    rate: float = 0.0
    key: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The ``(in, out)`` shape of the weight this node stands for."""
        return (self.A.shape[0], self.B.shape[1])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's term ``scale * (dropout(x) @ A) @ B`` in the adapters' dtype: (..., in) -> (..., out)."""
        h = x.to(self.A.dtype)
        if self.key is not None and self.rate:
            h = dropout(h, self.rate, self.key)
        return ((h @ self.A) @ self.B) * self.scale  # (..., r) -> (..., out), peft's order of operations

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (base + scale * A @ B)`` as ``x @ base + delta(x)``, as ``Linear.apply`` runs it
        (dropout included); (..., in) -> (..., out) in the base product's dtype."""
        base = self.base
        y = int8_matmul(x, base.q, base.scale) if isinstance(base, QuantizedWeight) else x @ base
        return (y + self.delta(x)).to(y.dtype)

    def merged(self, sign: float = 1.0) -> torch.Tensor:
        """``base + sign * scale * A @ B`` in ``base``'s dtype (computed in the wider of the two)."""
        if isinstance(self.base, (QuantizedWeight, LoraWeight)):
            raise ValueError("cfx.lora.merge / unmerge: the base weight is a "
                             f"{type(self.base).__name__}; merge into floating-point params "
                             "(cfx.quant.dequantize(params) first, or merge then quantize).")
        wide = torch.promote_types(self.base.dtype, self.A.dtype)
        delta = (self.A.to(wide) @ self.B.to(wide)) * self.scale  # (in, out)
        return (self.base.to(wide) + sign * delta).to(self.base.dtype)


tree_util.register_node(
    LoraWeight,
    lambda w: ((w.base, w.A, w.B, w.key), (w.scale, w.rate), ("base", "A", "B", "key")),
    lambda meta, children: LoraWeight(*children[:3], *meta, key=children[3]),
)


def is_weight_node(x: Any) -> bool:
    """A weight that is a pytree node rather than a tensor: ``LoraWeight``, ``QuantizedWeight`` or
    ``Float8Weight``."""
    return isinstance(x, (LoraWeight, QuantizedWeight, Float8Weight))


def weight_nodes_as_leaves(params: Any) -> Any:
    """``params`` with each ``LoraWeight`` standing as its base and each ``QuantizedWeight`` as its
    ``q``: one leaf per weight, the structure of the plain params (what the models' checks compare)."""
    def leaf(x: Any) -> Any:
        while isinstance(x, LoraWeight):
            x = x.base
        if isinstance(x, Float8Weight):
            return x.w
        return x.q if isinstance(x, QuantizedWeight) else x

    return tree_util.map(leaf, params, is_leaf=is_weight_node)
