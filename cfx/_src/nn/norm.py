"""Normalisation layers over the last dim: ``LayerNorm`` and ``RMSNorm``."""
from __future__ import annotations

import dataclasses

import torch


def _check_features(where: str, x: torch.Tensor, features: int) -> None:
    if x.shape[-1] != features:
        raise ValueError(f"{where}: x has {x.shape[-1]} features in its last dim, expected "
                         f"features={features} (x shape {tuple(x.shape)}).")


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` (``bias=False`` drops the shift)."""

    features: int
    eps: float = 1e-5
    bias: bool = True
    axis_name: str = "embed"

    def init(self, key: torch.Tensor) -> dict:
        del key  # deterministic init
        params = {"scale": torch.ones(self.features, dtype=torch.float32)}
        if self.bias:
            params["bias"] = torch.zeros(self.features, dtype=torch.float32)
        return params

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        _check_features("LayerNorm.apply", x, self.features)
        return torch.nn.functional.layer_norm(x, (self.features,), params["scale"],
                                              params.get("bias"), self.eps)

    def axes(self) -> dict:
        out = {"scale": (self.axis_name,)}
        if self.bias:
            out["bias"] = (self.axis_name,)
        return out


@dataclasses.dataclass(frozen=True)
class RMSNorm:
    """``x / sqrt(mean(x**2) + eps) * scale``; the statistic is taken in fp32 (as HF Llama does)."""

    features: int
    eps: float = 1e-6
    axis_name: str = "embed"

    def init(self, key: torch.Tensor) -> dict:
        del key  # deterministic init
        return {"scale": torch.ones(self.features, dtype=torch.float32)}

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        _check_features("RMSNorm.apply", x, self.features)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return params["scale"] * y.to(x.dtype)

    def axes(self) -> dict:
        return {"scale": (self.axis_name,)}
