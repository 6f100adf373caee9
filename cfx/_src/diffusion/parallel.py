"""Megatron tensor parallelism for the UNet's blocks (``Denoiser.tensor_parallel(axis)``; the Plan's
``model`` axis).

The rules that split a token model split the UNet too: ``heads`` and ``mlp`` over ``model``, the
rest replicated. Each block then runs between Megatron's two points, ``f`` (``pvary``: identity
forward, all-reduce of the input's gradient) and ``g`` (``psum`` of partial sums, the row-parallel
bias added once after it):

* a resnet (``ResnetBlock2D``): its hidden channels are split -- conv1 and the time embedding's
  projection by output channels, GroupNorm 2 on whole groups (the groups must split evenly, so
  each rank normalises exactly its own groups), conv2 by input channels, then ``g``; norm1 and the
  shortcut stay replicated;
* a transformer (``Transformer2D``): in each block the self- and cross-attention heads are split
  (``to_q/k/v`` by columns, ``to_out`` by rows, then ``g``), and the GEGLU feed-forward's hidden
  units: each rank computes its columns of the value and gate halves from the whole projection
  (stored as diffusers stores it, ``[value | gate]``, which a contiguous split cannot pair, so it
  stays replicated) and ``out`` by rows, then ``g``. The norms and proj_in / proj_out stay
  replicated.

A block issues 2 all-reduces (resnet: 1) of its activations in forward and as many in backward.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from cfx._src.diffusion.layers import ResnetBlock2D
from cfx._src.diffusion.transformer2d import Transformer2D
from cfx._src.lax import collectives as lax


def _g(h: torch.Tensor, p: dict, axis: str, op) -> torch.Tensor:
    """Out of the split region: ``op(h, w)`` summed over ``axis``, then the bias once (over the
    channels of an NCHW output, the last dim of a token one)."""
    y = lax.psum(op(h, p["w"]), axis)
    if "b" not in p:
        return y
    return y + (p["b"][:, None, None] if y.dim() == 4 else p["b"])


@dataclasses.dataclass(frozen=True)
class _Split:
    """A block split over ``axis``: the same ``init`` / ``axes`` (params are global; the rules shard them)."""

    block: Any
    axis: str = "model"

    def init(self, key: torch.Tensor) -> dict:
        return self.block.init(key)

    def axes(self) -> dict:
        return self.block.axes()


class TensorParallelResnet(_Split):
    """A ``ResnetBlock2D`` whose hidden channels are split over ``axis`` (module doc)."""

    def check(self, n: int) -> None:
        b = self.block
        if b.out_channels % n or b.groups % n:
            raise ValueError(f"tensor parallelism over axis {self.axis!r} of size {n}: a resnet's {b.out_channels} "
                             f"channels in {b.groups} groups do not split {n} ways by whole groups; use a model axis "
                             "size dividing both.")

    def apply(self, p: dict, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        n, b = lax.axis_size(self.axis), self.block
        self.check(n)
        parts = b._parts()
        c = b.out_channels // n
        conv1 = dataclasses.replace(parts["conv1"], out_channels=c)
        norm2 = dataclasses.replace(parts["norm2"], groups=b.groups // n, channels=c)
        h = conv1.apply(p["conv1"], lax.pvary(F.silu(parts["norm1"].apply(p["norm1"], x)), self.axis))  # (B, c, H, W)
        if b.temb_channels is not None:
            proj = dataclasses.replace(parts["time_emb_proj"], out_features=c)
            h = h + proj.apply(p["time_emb_proj"], lax.pvary(F.silu(temb), self.axis))[:, :, None, None]
        h = F.silu(norm2.apply(p["norm2"], h))
        h = _g(h, p["conv2"], self.axis, lambda h, w: F.conv2d(h, w, padding=1))  # (B, out, H, W)
        skip = parts["conv_shortcut"].apply(p["conv_shortcut"], x) if "conv_shortcut" in parts else x
        return skip + h


class TensorParallelTransformer2D(_Split):
    """A ``Transformer2D`` whose blocks' heads and feed-forward units are split over ``axis``."""

    def check(self, n: int) -> None:
        b = self.block
        if b.heads % n or (4 * b.channels) % n:
            raise ValueError(f"tensor parallelism over axis {self.axis!r} of size {n}: a transformer's {b.heads} "
                             f"heads (and {4 * b.channels} feed-forward units) do not split {n} ways; use a model "
                             "axis size dividing them.")

    def apply(self, p: dict, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        n = lax.axis_size(self.axis)
        self.check(n)
        return self.block.apply_with(p, x, context, lambda blk, pb, h, c: self._run(blk, pb, h, c, n))

    def _run(self, blk, p: dict, x: torch.Tensor, context: torch.Tensor, n: int) -> torch.Tensor:
        L, axis = blk._sublayers, self.axis
        matmul = lambda h, w: h @ w  # noqa: E731
        for i, c in (("1", None), ("2", context)):
            attn = L["attn" + i]
            local = dataclasses.replace(attn, heads=attn.heads // n)  # (B, T, heads/n * head_dim) out
            h = lax.pvary(L["norm" + i].apply(p["norm" + i], x), axis)
            x = x + _g(local.heads_out(p["attn" + i], h, c), p["attn" + i]["to_out"], axis, matmul)
        h = lax.pvary(L["norm3"].apply(p["norm3"], x), axis)
        proj, inner, r = p["ff"]["proj"], 4 * blk.dim, int(lax.axis_index(axis))
        k = inner // n
        cols = torch.cat([torch.arange(r * k, (r + 1) * k), inner + torch.arange(r * k, (r + 1) * k)]).to(h.device)
        # the whole projection enters the split region (f): its gradient, columns from every rank, is summed
        w, bias = (lax.pvary(proj[k], axis).index_select(dim, cols) for k, dim in (("w", 1), ("b", 0)))
        hg = h @ w + bias
        value, gate = hg.chunk(2, dim=-1)  # (B, T, inner/n) each: this rank's columns of both halves
        return x + _g(value * F.gelu(gate), p["ff"]["out"], axis, matmul)


def tensor_parallel_block(block: Any, axis: str = "model") -> Any:
    """The tensor-parallel form of a UNet block (a resnet or a transformer)."""
    if isinstance(block, ResnetBlock2D):
        return TensorParallelResnet(block, axis)
    if isinstance(block, Transformer2D):
        return TensorParallelTransformer2D(block, axis)
    raise ValueError(f"tensor parallelism: no tensor-parallel form of a {type(block).__name__}; apply it before "
                     "the other block transforms (ZeRO-3's gathers, remat).")
