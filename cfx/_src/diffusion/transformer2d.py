"""The transformer a Stable Diffusion UNet puts after its resnets (diffusers' ``Transformer2DModel``
as SD uses it): GroupNorm -> proj_in (1x1 conv or Linear) -> ``BasicTransformerBlock`` s -> proj_out,
plus the input. A block is pre-LayerNorm self-attention, cross-attention over the text encoder's
states and a GEGLU feed-forward, each residual. Params are named as diffusers names its submodules."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cfx._src.diffusion.composite import Composite
from cfx._src.nn.attention import attention
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.linear import Linear
from cfx._src.nn.norm import GroupNorm, LayerNorm
from cfx._src.nn.sublayers import keep_sublayers


@dataclasses.dataclass(frozen=True)
class CrossAttention(Composite):
    """diffusers' ``Attention`` (SDPA processor): ``to_out(attn(to_q(x), to_k(c), to_v(c)))`` with
    ``c = context`` (or ``x`` when ``context_dim`` is None); q/k/v have no bias, heads are head-major."""

    query_dim: int
    heads: int
    head_dim: int
    context_dim: int | None = None
    impl: str = "auto"

    def __post_init__(self):
        inner, ctx = self.heads * self.head_dim, self.context_dim or self.query_dim
        keep_sublayers(self, {
            "to_q": Linear(self.query_dim, inner, bias=False, axes_names=("embed", "heads")),
            "to_k": Linear(ctx, inner, bias=False, axes_names=("context", "heads")),
            "to_v": Linear(ctx, inner, bias=False, axes_names=("context", "heads")),
            "to_out": Linear(inner, self.query_dim, axes_names=("heads", "embed"))})

    def apply(self, p: dict, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return self._sublayers["to_out"].apply(p["to_out"], self.heads_out(p, x, context))  # (B, T, query_dim)

    def heads_out(self, p: dict, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """The heads' outputs before ``to_out``: ``(B, T, heads * head_dim)``."""
        L = self._sublayers
        c = x if self.context_dim is None else context
        B, T, _ = x.shape
        q = L["to_q"].apply(p["to_q"], x).view(B, T, self.heads, self.head_dim)  # (B, T, H, D)
        k = L["to_k"].apply(p["to_k"], c).view(B, c.shape[1], self.heads, self.head_dim)  # (B, S, H, D)
        v = L["to_v"].apply(p["to_v"], c).view(B, c.shape[1], self.heads, self.head_dim)
        return attention(q, k, v, causal=False, impl=self.impl).reshape(B, T, self.heads * self.head_dim)


@dataclasses.dataclass(frozen=True)
class GEGLUFeedForward(Composite):
    """diffusers' ``FeedForward(activation_fn="geglu")``: ``out(h * gelu(g))`` with ``h, g =
    proj(x).chunk(2)``, inner width ``4 * dim`` (diffusers' ``net.0.proj`` and ``net.2``)."""

    dim: int

    def __post_init__(self):
        inner = 4 * self.dim
        # proj's columns are [value | gate]: a contiguous split would not pair them, so "geglu" stays
        # whole under Megatron's rules (each rank computes its columns of both halves)
        keep_sublayers(self, {"proj": Linear(self.dim, 2 * inner, axes_names=("embed", "geglu")),
                              "out": Linear(inner, self.dim, axes_names=("mlp", "embed"))})

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        L = self._sublayers
        h, gate = L["proj"].apply(p["proj"], x).chunk(2, dim=-1)  # (..., inner) each
        return L["out"].apply(p["out"], h * F.gelu(gate))


@dataclasses.dataclass(frozen=True)
class BasicTransformerBlock(Composite):
    """``x += attn1(norm1(x)); x += attn2(norm2(x), context); x += ff(norm3(x))`` over ``(B, T, dim)``."""

    dim: int
    heads: int
    context_dim: int
    eps: float = 1e-5
    impl: str = "auto"

    def __post_init__(self):
        d, head_dim = self.dim, self.dim // self.heads
        keep_sublayers(self, {
            "norm1": LayerNorm(d, self.eps), "attn1": CrossAttention(d, self.heads, head_dim, impl=self.impl),
            "norm2": LayerNorm(d, self.eps),
            "attn2": CrossAttention(d, self.heads, head_dim, self.context_dim, impl=self.impl),
            "norm3": LayerNorm(d, self.eps), "ff": GEGLUFeedForward(d)})

    def apply(self, p: dict, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        L = self._sublayers
        x = x + L["attn1"].apply(p["attn1"], L["norm1"].apply(p["norm1"], x))
        x = x + L["attn2"].apply(p["attn2"], L["norm2"].apply(p["norm2"], x), context)
        return x + L["ff"].apply(p["ff"], L["norm3"].apply(p["norm3"], x))


@dataclasses.dataclass(frozen=True)
class Transformer2D(Composite):
    """diffusers' ``Transformer2DModel`` on continuous input: ``x + proj_out(blocks(proj_in(norm(x))))``
    over the ``H*W`` positions as tokens; proj_in/out are 1x1 convs, or Linears when
    ``use_linear_projection``. ``heads`` split ``channels`` (head dim ``channels // heads``)."""

    channels: int
    heads: int
    context_dim: int
    layers: int = 1
    groups: int = 32
    use_linear_projection: bool = False
    impl: str = "auto"

    def __post_init__(self):
        C = self.channels
        def proj(c_in: str, c_out: str) -> Linear | Conv2d:  # axis names of the input and output channels
            return (Linear(C, C, axes_names=(c_in, c_out)) if self.use_linear_projection
                    else Conv2d(C, C, 1, axes_names=(c_out, c_in)))
        keep_sublayers(self, {
            "norm": GroupNorm(self.groups, C, 1e-6), "proj_in": proj("conv_out", "embed"),
            "transformer_blocks": [BasicTransformerBlock(C, self.heads, self.context_dim, impl=self.impl)
                                   for _ in range(self.layers)],
            "proj_out": proj("embed", "conv_out")})

    def apply(self, p: dict, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.apply_with(p, x, context, lambda block, pb, h, c: block.apply(pb, h, c))

    def apply_with(self, p: dict, x: torch.Tensor, context: torch.Tensor, run_block) -> torch.Tensor:
        """``apply`` with each ``BasicTransformerBlock`` run by ``run_block(block, params, h, context)``
        (a tensor-parallel one, ``diffusion.parallel``)."""
        L = self._sublayers
        B, C, H, W = x.shape
        h = L["norm"].apply(p["norm"], x)
        if not self.use_linear_projection:
            h = L["proj_in"].apply(p["proj_in"], h)
        h = h.permute(0, 2, 3, 1).reshape(B, H * W, C)  # (B, HW, C)
        if self.use_linear_projection:
            h = L["proj_in"].apply(p["proj_in"], h)
        for block, pb in zip(L["transformer_blocks"], p["transformer_blocks"]):
            h = run_block(block, pb, h, context)
        if self.use_linear_projection:
            h = L["proj_out"].apply(p["proj_out"], h)
        h = h.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous()  # (B, C, H, W)
        if not self.use_linear_projection:
            h = L["proj_out"].apply(p["proj_out"], h)
        return h + x
