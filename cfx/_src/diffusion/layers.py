"""The 2-D building blocks Stable Diffusion's VAE and UNet share, as pure functions over params.

Each layer is diffusers' module of the same name on its default path (no dropout, output scale 1),
with params named as diffusers names its submodules, so a diffusers state dict maps onto them by
renaming alone (``weight`` -> ``w`` / ``scale``, ``bias`` -> ``b`` / ``bias``, and a transpose for
the attention's Linear weights, which cfx lays out ``(in, out)``)::

    ResnetBlock2D    {"norm1", "conv1", ["time_emb_proj"], "norm2", "conv2", ["conv_shortcut"]}
    Downsample2D     {"conv"}         3x3 stride-2 conv (padding=0: diffusers' (0, 1, 0, 1) pad first)
    Upsample2D       {"conv"}         nearest 2x, then a 3x3 conv
    SpatialAttention {"group_norm", "to_q", "to_k", "to_v", "to_out"}

Activations are ``(B, C, H, W)``. Conv weights are torch's ``(out, in, k, k)``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cfx._src.nn.attention import attention
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.norm import GroupNorm


def _check_nchw(where: str, x: torch.Tensor, channels: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != channels:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: x must be (B, {channels}, H, W), got {got}; pass a 4-D NCHW tensor with "
                         f"{channels} channels.")


@dataclasses.dataclass(frozen=True)
class ResnetBlock2D:
    """``x + conv2(SiLU(norm2(conv1(SiLU(norm1(x))) + temb_proj))))``, the skip a 1x1 ``conv_shortcut``
    when ``in_channels != out_channels``. ``temb_channels`` adds ``time_emb_proj`` (a Linear of
    ``SiLU(temb)``, broadcast over H and W); ``apply`` then requires ``temb`` ``(B, temb_channels)``."""

    in_channels: int
    out_channels: int
    groups: int = 32
    eps: float = 1e-6
    temb_channels: int | None = None

    def _parts(self) -> dict:
        cin, cout = self.in_channels, self.out_channels
        # conv1's output channels are the block's hidden units ("mlp": Megatron's rules split them,
        # conv1 by columns and conv2 by rows, as an MLP's fc and proj)
        parts = {"norm1": GroupNorm(self.groups, cin, self.eps, axis_name="conv_in"),
                 "conv1": Conv2d(cin, cout, 3, padding=1, axes_names=("mlp", "conv_in")),
                 "norm2": GroupNorm(self.groups, cout, self.eps, axis_name="mlp"),
                 "conv2": Conv2d(cout, cout, 3, padding=1, axes_names=("conv_out", "mlp"))}
        if self.temb_channels is not None:
            parts["time_emb_proj"] = Linear(self.temb_channels, cout, axes_names=("temb", "mlp"))
        if cin != cout:
            parts["conv_shortcut"] = Conv2d(cin, cout, 1)
        return parts

    def init(self, key: torch.Tensor) -> dict:
        parts = self._parts()
        return {name: layer.init(k) for (name, layer), k in zip(parts.items(), split_keys(key, len(parts)))}

    def axes(self) -> dict:
        return {name: layer.axes() for name, layer in self._parts().items()}

    def apply(self, p: dict, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, in, H, W)`` (and ``temb`` ``(B, temb_channels)``) -> ``(B, out, H, W)``."""
        _check_nchw("ResnetBlock2D.apply", x, self.in_channels)
        parts = self._parts()
        h = parts["conv1"].apply(p["conv1"], F.silu(parts["norm1"].apply(p["norm1"], x)))
        if self.temb_channels is not None:
            if temb is None or temb.dim() != 2 or temb.shape != (x.shape[0], self.temb_channels):
                got = None if temb is None else tuple(temb.shape)
                raise ValueError(f"ResnetBlock2D.apply: temb must be (B, temb_channels) = "
                                 f"{(x.shape[0], self.temb_channels)}, got {got}.")
            h = h + parts["time_emb_proj"].apply(p["time_emb_proj"], F.silu(temb))[:, :, None, None]
        elif temb is not None:
            raise ValueError("ResnetBlock2D.apply: got a temb but the block was built with temb_channels=None; "
                             "build it with temb_channels=temb.shape[1].")
        h = parts["conv2"].apply(p["conv2"], F.silu(parts["norm2"].apply(p["norm2"], h)))
        skip = parts["conv_shortcut"].apply(p["conv_shortcut"], x) if "conv_shortcut" in parts else x
        return skip + h


@dataclasses.dataclass(frozen=True)
class Downsample2D:
    """diffusers' ``Downsample2D(use_conv=True)``: a 3x3 stride-2 conv with ``padding``; ``padding=0``
    first pads the right and bottom by one (the VAE encoder's), so H and W halve either way."""

    channels: int
    padding: int = 1

    @property
    def conv(self) -> Conv2d:
        return Conv2d(self.channels, self.channels, 3, stride=2, padding=self.padding)

    def init(self, key: torch.Tensor) -> dict:
        return {"conv": self.conv.init(key)}

    def axes(self) -> dict:
        return {"conv": self.conv.axes()}

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, C, ceil(H/2), ceil(W/2))`` (padding 1) or ``floor`` (padding 0)."""
        _check_nchw("Downsample2D.apply", x, self.channels)
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv.apply(p["conv"], x)


@dataclasses.dataclass(frozen=True)
class Upsample2D:
    """diffusers' ``Upsample2D(use_conv=True)``: nearest-neighbour 2x (or to ``output_size``), then a
    3x3 conv."""

    channels: int

    @property
    def conv(self) -> Conv2d:
        return Conv2d(self.channels, self.channels, 3, padding=1)

    def init(self, key: torch.Tensor) -> dict:
        return {"conv": self.conv.init(key)}

    def axes(self) -> dict:
        return {"conv": self.conv.axes()}

    def apply(self, p: dict, x: torch.Tensor, output_size: tuple[int, int] | None = None) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, C, 2H, 2W)``, or ``(B, C, *output_size)``."""
        _check_nchw("Upsample2D.apply", x, self.channels)
        if output_size is None:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        else:
            x = F.interpolate(x, size=tuple(output_size), mode="nearest")
        return self.conv.apply(p["conv"], x)


@dataclasses.dataclass(frozen=True)
class SpatialAttention:
    """Self-attention over the ``H*W`` positions (diffusers' ``Attention`` in the VAE's mid block):
    ``x + to_out(attention(to_q(n), to_k(n), to_v(n)))`` with ``n = group_norm(x)`` as tokens
    ``(B, HW, C)``. ``heads`` splits C head-major (feature ``h * d + i`` is head ``h``'s channel i).
    ``impl`` is ``cfx.nn.attention``'s."""

    channels: int
    groups: int = 32
    eps: float = 1e-6
    heads: int = 1
    impl: str = "auto"

    def __post_init__(self):
        if self.heads <= 0 or self.channels % self.heads:
            raise ValueError(f"SpatialAttention: {self.channels} channels do not split into {self.heads} heads; "
                             "use a head count dividing the channels.")

    def _parts(self) -> dict:
        C = self.channels
        proj = Linear(C, C, axes_names=("embed", "heads"))
        return {"group_norm": GroupNorm(self.groups, C, self.eps, axis_name="embed"),
                "to_q": proj, "to_k": proj, "to_v": proj,
                "to_out": Linear(C, C, axes_names=("heads", "embed"))}

    def init(self, key: torch.Tensor) -> dict:
        parts = self._parts()
        return {name: layer.init(k) for (name, layer), k in zip(parts.items(), split_keys(key, len(parts)))}

    def axes(self) -> dict:
        return {name: layer.axes() for name, layer in self._parts().items()}

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, C, H, W)``."""
        _check_nchw("SpatialAttention.apply", x, self.channels)
        parts = self._parts()
        B, C, H, W = x.shape
        n = parts["group_norm"].apply(p["group_norm"], x).flatten(2).transpose(1, 2)  # (B, HW, C)
        heads = lambda t: t.unflatten(-1, (self.heads, C // self.heads))  # noqa: E731  (B, HW, heads, d)
        q, k, v = (heads(parts[name].apply(p[name], n)) for name in ("to_q", "to_k", "to_v"))
        o = attention(q, k, v, causal=False, impl=self.impl).flatten(2)  # (B, HW, C)
        o = parts["to_out"].apply(p["to_out"], o)
        return x + o.transpose(1, 2).reshape(B, C, H, W)
