"""Normalisation layers over the last dim: ``LayerNorm`` and ``RMSNorm``."""
from __future__ import annotations

import dataclasses

import torch

from cfx_kernels.norms import add_layer_norm, add_rms_norm, layer_norm, rms_norm


def _check_features(where: str, x: torch.Tensor, features: int) -> None:
    if x.shape[-1] != features:
        raise ValueError(f"{where}: x has {x.shape[-1]} features in its last dim, expected "
                         f"features={features} (x shape {tuple(x.shape)}).")


def _fusable(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """The fused add takes operands of one shape and dtype; others add (broadcasting, promoting) first."""
    return residual.shape == x.shape and residual.dtype == x.dtype


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` (``bias=False`` drops the shift).

    ``impl``: ``"auto"`` (the fused Triton kernel on CUDA, ``F.layer_norm`` elsewhere),
    ``"triton"`` or ``"reference"`` (see ``cfx_kernels.norms``).
    """

    features: int
    eps: float = 1e-5
    bias: bool = True
    axis_name: str = "embed"
    impl: str = "auto"

    def init(self, key: torch.Tensor) -> dict:
        del key  # deterministic init
        params = {"scale": torch.ones(self.features, dtype=torch.float32)}
        if self.bias:
            params["bias"] = torch.zeros(self.features, dtype=torch.float32)
        return params

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        _check_features("LayerNorm.apply", x, self.features)
        return layer_norm(x, params["scale"], params.get("bias"), eps=self.eps, impl=self.impl)

    def add_apply(self, params: dict, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` and ``apply(params, s)``: one fused pass on CUDA (``add_layer_norm``)."""
        _check_features("LayerNorm.add_apply", x, self.features)
        if not _fusable(x, residual):
            s = x + residual
            return s, self.apply(params, s)
        return add_layer_norm(x, residual, params["scale"], params.get("bias"), eps=self.eps, impl=self.impl)

    def axes(self) -> dict:
        out = {"scale": (self.axis_name,)}
        if self.bias:
            out["bias"] = (self.axis_name,)
        return out


@dataclasses.dataclass(frozen=True)
class RMSNorm:
    """``x / sqrt(mean(x**2) + eps) * scale``; the statistic is taken in fp32 (as HF Llama does).

    ``impl``: ``"auto"`` (the fused Triton kernel on CUDA, plain PyTorch elsewhere), ``"triton"``
    or ``"reference"`` (see ``cfx_kernels.norms``).
    """

    features: int
    eps: float = 1e-6
    axis_name: str = "embed"
    impl: str = "auto"

    def init(self, key: torch.Tensor) -> dict:
        del key  # deterministic init
        return {"scale": torch.ones(self.features, dtype=torch.float32)}

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        _check_features("RMSNorm.apply", x, self.features)
        return rms_norm(x, params["scale"], eps=self.eps, impl=self.impl)

    def add_apply(self, params: dict, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` and ``apply(params, s)``: one fused pass on CUDA (``add_rms_norm``)."""
        _check_features("RMSNorm.add_apply", x, self.features)
        if not _fusable(x, residual):
            s = x + residual
            return s, self.apply(params, s)
        return add_rms_norm(x, residual, params["scale"], eps=self.eps, impl=self.impl)

    def axes(self) -> dict:
        return {"scale": (self.axis_name,)}


@dataclasses.dataclass(frozen=True)
class GroupNorm:
    """``F.group_norm`` over ``(B, C, ...)``: ``groups`` groups of channels normalised together, then
    a per-channel ``scale`` and ``bias`` (diffusers' ``GroupNorm(num_groups, num_channels, eps)``)."""

    groups: int
    channels: int
    eps: float = 1e-5
    axis_name: str = "conv_out"

    def __post_init__(self):
        if self.groups <= 0 or self.channels % self.groups:
            raise ValueError(f"GroupNorm: {self.channels} channels do not split into {self.groups} groups; use a "
                             "group count dividing the channels.")

    def init(self, key: torch.Tensor) -> dict:
        del key  # deterministic init
        return {"scale": torch.ones(self.channels, dtype=torch.float32),
                "bias": torch.zeros(self.channels, dtype=torch.float32)}

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.channels:
            raise ValueError(f"GroupNorm.apply: x must be (B, {self.channels}, ...), got {tuple(x.shape)}.")
        return torch.nn.functional.group_norm(x, self.groups, params["scale"], params["bias"], self.eps)

    def axes(self) -> dict:
        return {"scale": (self.axis_name,), "bias": (self.axis_name,)}
