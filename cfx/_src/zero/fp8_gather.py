"""ZeRO-3's float8 all-gather: a gathered layer's float8 Linear weights (``Float8Layer.gathered_in_fp8``) travel
as their e4m3 casts, one byte an element where bf16 takes two.

Each rank casts its pieces before the gather, by the amax of the whole weight -- the pieces' amaxes all-reduced
(max) over the ZeRO axis and the axes that split the weight besides (Megatron's ``model``) -- which is the cast
the tensorwise recipe makes of the gathered weight: the same scale, the same float8 values, bit for bit, in a
buffer half the size. The Linear takes the cast as it comes (``fp8.Float8Gathered``); a stand-in of the weight's
shape takes its gradient, which the gather's backward reduce-scatters as ever (``_GatherFn``'s). Backward's
input gradient re-gathers the float8 buffer (``RegatherHooks``), casting the same pieces the same way again.

The gradients' reduce-scatter in e5m2 is ``fp8_reduce.py``'s.
"""
from __future__ import annotations

import torch

from cfx._src.lax import comm, groups
from cfx._src.nn.fp8 import E4M3, scale_from_amax, to_fp8
from cfx._src.zero.source import GatherFn, ShardSource


class Float8Source(ShardSource):
    """A gathered layer's float8 weights (module doc); ``over``: the ZeRO axis and the axes splitting them."""

    def __init__(self, layout, axis: str, pieces: list[torch.Tensor], dtype: torch.dtype, over: tuple[str, ...]):
        super().__init__(layout, axis, pieces, dtype)
        self.over = over
        self.scales: torch.Tensor | None = None  # per weight, fp32: set by each cast
        self.cast: list[torch.Tensor] = []        # the weights' e4m3 views of the gathered buffer (forward's)

    def shard(self, *, backward: bool) -> torch.Tensor:
        del backward
        with torch.no_grad():
            pieces = [p.detach() for p in self.pieces]
            amax = torch.stack([p.abs().amax().float() for p in pieces])
            amax = comm.all_reduce(amax, groups.axes(self.over, "cfx.zero.gathered float8"), "max")
            self.scales = scale_from_amax(amax, E4M3)
            return torch.cat([to_fp8(p, E4M3, s).view(torch.uint8) for p, s in zip(pieces, self.scales)])

    def gather(self, *, backward: bool) -> torch.Tensor:
        return super().gather(backward=backward).view(E4M3)


class GatherFp8Fn(GatherFn):
    """Forward: the float8 views of the gathered buffer kept on the source (``cast``) and, as the outputs, zero
    stand-ins of the weights' shapes (expanded: no memory) through which their gradients come back. Backward:
    ``GatherFn``'s reduce-scatter."""

    @staticmethod
    def forward(ctx, src, *inputs):
        ctx.src = src
        ctx.set_materialize_grads(False)
        src.cast = src.layout.leaves_of_full(src.gather(backward=False))
        zero = inputs[0].new_zeros((), dtype=src.dtype)
        return tuple(zero.expand(shape) for shape in src.layout.shapes)


def over_axes(axis: str, splits) -> tuple[str, ...]:
    """The ZeRO ``axis`` and every axis the weights' ``Split`` s name besides (each once)."""
    out = [axis]
    for s in splits:
        out += [a for a in s.k + s.n if a not in out]
    return tuple(out)

