"""``Linear``: ``y = x @ w + b`` with ``w`` laid out ``(in_features, out_features)``."""
from __future__ import annotations

import dataclasses
import math

import torch

from cfx._src.core import random
from cfx._src.nn.lora_weight import LoraWeight
from cfx._src.nn.fp8 import Float8Weight
from cfx._src.precision.quant import QuantizedWeight
from cfx_kernels.int8_matmul import int8_matmul


def split_keys(key: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` independent child keys as a list (``cfx.random.split`` stacks them)."""
    return list(random.split(key, n))


def init_normal(key: torch.Tensor, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """``normal(0, std)`` in fp32 from an explicit key (the init every layer here uses)."""
    return random.normal(key, shape, dtype=torch.float32) * std


@dataclasses.dataclass(frozen=True)
class Linear:
    """A dense layer. ``w`` is ``(in_features, out_features)`` (HF ``Conv1D`` layout).

    ``axes`` names the logical axes of ``w``'s two dims (``b`` takes the second). ``init_std=None``
    draws ``w`` from ``normal(0, 1/sqrt(in_features))``; biases start at zero. A ``w`` made by
    ``cfx.quant.quantize`` (a ``QuantizedWeight``) runs the int8 weight-only matmul kernel; one
    made by ``cfx.lora.attach`` (a ``LoraWeight``) adds its low-rank term to its base's product.
    """

    in_features: int
    out_features: int
    bias: bool = True
    axes_names: tuple[str, str] = ("embed", "mlp")
    init_std: float | None = None

    def __post_init__(self):
        for name in ("in_features", "out_features"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Linear: {name} must be a positive int, got {v!r}.")
        if len(self.axes_names) != 2:
            raise ValueError(f"Linear: axes_names must name 2 dims, got {self.axes_names!r}.")

    def init(self, key: torch.Tensor) -> dict:
        std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(self.in_features)
        params = {"w": init_normal(key, (self.in_features, self.out_features), std)}
        if self.bias:
            params["b"] = torch.zeros(self.out_features, dtype=torch.float32)
        return params

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (..., out)
        shape = x.shape
        if shape[-1] != self.in_features:
            raise ValueError(f"Linear.apply: x has {shape[-1]} features in its last dim, expected "
                             f"in_features={self.in_features} (x shape {tuple(shape)}).")
        w = params["w"]
        if type(w) is not torch.Tensor:  # (a plain weight, the usual case, skips both tests)
            if isinstance(w, LoraWeight):  # x @ base (+ b) + scale * (x A) B: the merged weight never exists
                y = self.apply({**params, "w": w.base}, x)
                return (y + w.delta(x)).to(y.dtype)
            if isinstance(w, QuantizedWeight):
                return int8_matmul(x, w.q, w.scale, params["b"] if self.bias else None)
            if isinstance(w, Float8Weight):  # the three GEMMs in float8 (an fp8 policy's)
                return w.linear(x, params["b"] if self.bias else None)
        if not self.bias:
            return x @ w
        # one addmm with the bias fused; w's gradient comes out contiguous in w's own layout
        y = torch.addmm(params["b"], x.reshape(-1, self.in_features), w)  # (N, out)
        return y.view(*shape[:-1], self.out_features)

    def axes(self) -> dict:
        out = {"w": tuple(self.axes_names)}
        if self.bias:
            out["b"] = (self.axes_names[1],)
        return out
