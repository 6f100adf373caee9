"""``Conv2d``: a 2-D convolution over ``(B, C, H, W)`` with PyTorch's weight layout
``(out_channels, in_channels, kh, kw)``, so ``diffusers`` / ``torch.nn.Conv2d`` state dicts map
onto the params without a transpose. A ``w`` made by ``cfx.quant.quantize`` (a ``QuantizedWeight``,
int8 per output channel) is dequantised into the input's dtype for the call."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from cfx._src.nn.linear import init_normal
from cfx._src.precision.quant import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class Conv2d:
    """``F.conv2d`` with params ``{"w": (out, in, k, k), "b": (out,)}``. ``init_std=None`` draws ``w``
    from ``normal(0, 1/sqrt(in * k * k))``; the bias starts at zero. ``axes_names`` names the two
    channel dims (the kernel's spatial dims are ``"kernel"``)."""

    in_channels: int
    out_channels: int
    kernel_size: int = 3
    stride: int = 1
    padding: int = 0
    bias: bool = True
    axes_names: tuple[str, str] = ("conv_out", "conv_in")
    init_std: float | None = None

    def __post_init__(self):
        for name in ("in_channels", "out_channels", "kernel_size", "stride"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Conv2d: {name} must be a positive int, got {v!r}.")
        if not isinstance(self.padding, int) or self.padding < 0:
            raise ValueError(f"Conv2d: padding must be a non-negative int, got {self.padding!r}.")

    def init(self, key: torch.Tensor) -> dict:
        k = self.kernel_size
        std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(self.in_channels * k * k)
        params = {"w": init_normal(key, (self.out_channels, self.in_channels, k, k), std)}
        if self.bias:
            params["b"] = torch.zeros(self.out_channels, dtype=torch.float32)
        return params

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d.apply: x must be (B, {self.in_channels}, H, W), got {tuple(x.shape)}.")
        w = params["w"]
        if isinstance(w, QuantizedWeight):
            # weight-only int8: the (out, in, k, k) copy in x's dtype lives only for this call
            w = w.dequantize().to(x.dtype)
        return F.conv2d(x, w, params.get("b") if self.bias else None, stride=self.stride,
                        padding=self.padding)

    def axes(self) -> dict:
        out = {"w": (*self.axes_names, "kernel", "kernel")}
        if self.bias:
            out["b"] = (self.axes_names[0],)
        return out
