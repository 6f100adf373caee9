"""Feed-forward block: ``MLP`` with gelu / gelu_tanh / relu, or gated ``swiglu``."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.sublayers import keep_sublayers

ACTIVATIONS = ("gelu_tanh", "gelu", "quick_gelu", "relu", "swiglu")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """Pointwise activation by name. ``gelu_tanh`` is GPT-2's ``gelu_new`` (tanh approximation);
    ``quick_gelu`` is CLIP's ``x * sigmoid(1.702 x)``."""
    if name == "gelu_tanh":
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as one fused kernel
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"activation: unknown name {name!r}; use one of {ACTIVATIONS[:4] + ('silu',)}.")


@dataclasses.dataclass(frozen=True)
class MLP:
    """``proj(act(fc(x)))``, or for ``swiglu`` ``down(silu(gate(x)) * up(x))``.

    Params: ``{"fc", "proj"}`` or ``{"gate", "up", "down"}`` (each a ``Linear``). The input
    projections are column-parallel over ``"mlp"``, the output projection row-parallel.
    ``out_init_std`` (default ``init_std``) is the std of the output projection.
    """

    features: int
    hidden: int
    activation: str = "gelu_tanh"
    bias: bool = True
    init_std: float = 0.02
    out_init_std: float | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLP: unknown activation {self.activation!r}; use one of {ACTIVATIONS}.")
        keep_sublayers(self, self._build_layers())

    def _layers(self) -> dict:
        return self._sublayers

    def _build_layers(self) -> dict:
        out_std = self.init_std if self.out_init_std is None else self.out_init_std
        up = Linear(self.features, self.hidden, bias=self.bias, axes_names=("embed", "mlp"),
                    init_std=self.init_std)
        down = Linear(self.hidden, self.features, bias=self.bias, axes_names=("mlp", "embed"),
                      init_std=out_std)
        if self.activation == "swiglu":
            return {"gate": up, "up": up, "down": down}
        return {"fc": up, "proj": down}

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        keys = split_keys(key, len(layers))
        return {name: layer.init(k) for (name, layer), k in zip(layers.items(), keys)}

    @property
    def out_name(self) -> str:
        """The name of the output projection's params (``down`` for SwiGLU, else ``proj``)."""
        return "down" if self.activation == "swiglu" else "proj"

    def hidden_out(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """The activated hidden layer, before the output projection: (..., C) -> (..., hidden)."""
        layers = self._layers()
        if self.activation == "swiglu":
            return F.silu(layers["gate"].apply(params["gate"], x)) * layers["up"].apply(params["up"], x)
        return activation(self.activation, layers["fc"].apply(params["fc"], x))

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        # (..., C) -> (..., hidden) -> (..., C)
        out = self._layers()[self.out_name]
        return out.apply(params[self.out_name], self.hidden_out(params, x))

    def axes(self) -> dict:
        return {name: layer.axes() for name, layer in self._layers().items()}

