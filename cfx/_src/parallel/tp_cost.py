"""What 1D (Megatron), 2D, 2.5D and 3D tensor parallelism cost per transformer block, in closed form:
the bytes one rank sends for a block's forward and backward (ring algorithms: an all-gather of a
``b``-byte block sends ``(n-1) b``, a reduce-scatter of ``b`` bytes ``(n-1)/n b``, an all-reduce
``2 (n-1)/n b``), the ranks it talks to, and its share of the block's params and activations.

With ``M = B T`` tokens and ``sum KN`` the block's weight elements, per rank (``q``: the grid's side):

* 1D over ``n``: ``8 (n-1)/n M C`` (Megatron's two all-reduces each way); ``n - 1`` peers.
* 2D: ``2 (q-1)/q^2 (M sum K_in + sum KN)`` (SUMMA: inputs and weights gathered, their cotangents
  reduce-scattered) plus the norms' statistics and the replicated biases'/scales' gradient sums;
  ``2 (q-1)`` peers.
* 2.5D (``q x q x d``): the inputs' term over ``d q^2``, weights' as 2D, plus their gradients' sum
  over ``dep``; ``2 (q-1) + (d-1)`` peers.
* 3D: ``2 (q-1)/q^3 (M sum K_in + sum KN + M sum N)`` (inputs and weights gathered, outputs
  reduce-scattered); ``3 (q-1)`` peers, ``q - 1`` per collective.

``K_in`` runs over the Linears' *gathered inputs* (q, k, v share one), ``N`` over their outputs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

SCHEMES = ("1d", "2d", "2.5d", "3d")


@dataclasses.dataclass(frozen=True)
class BlockDims:
    """A transformer block's sizes: batch ``B``, length ``T``, features ``C``, MLP hidden ``F``,
    attention width ``A`` (heads x head_dim), k/v width ``Akv``."""

    B: int
    T: int
    C: int
    F: int
    A: int
    Akv: int
    bias: bool = True
    layernorm: bool = True
    swiglu: bool = False

    @classmethod
    def of(cls, block: Any, B: int, T: int) -> "BlockDims":
        layers = block._layers()
        attn, mlp = layers["attn"], layers["mlp"]
        return cls(B, T, attn.features, mlp.hidden, attn.n_heads * attn.dim, attn.kv_heads * attn.dim,
                   block.bias, block.norm == "layernorm", mlp.activation == "swiglu")

    @property
    def M(self) -> int:
        return self.B * self.T

    def linears(self) -> list[tuple[int, int]]:
        """``(in, out)`` of every Linear: q, k, v, o, then the MLP's."""
        mlp = [(self.C, self.F)] * (2 if self.swiglu else 1) + [(self.F, self.C)]
        return [(self.C, self.A), (self.C, self.Akv), (self.C, self.Akv), (self.A, self.C)] + mlp

    def inputs(self) -> list[int]:
        """The widths of the gathered inputs: q/k/v's, o's, the MLP's first (shared by gate and up), its last."""
        return [self.C, self.A, self.C, self.F]

    def norm_params(self) -> int:
        return 2 if self.layernorm and self.bias else 1  # scale (+ a LayerNorm's bias) per norm


def grid_of(scheme: str, P: int) -> tuple[float, int]:
    """``(q, d)`` for ``P`` ranks: 1D ``(P, 1)``; 2D ``(sqrt P, 1)`` (a float where ``P`` is no square:
    formula only); 2.5D the largest ``q`` with ``q^2 d = P``, ``d >= 2``; 3D ``(cbrt P, cbrt P)``."""
    if scheme == "1d":
        return P, 1
    if scheme == "2d":
        q = math.isqrt(P)
        return (q if q * q == P else math.sqrt(P)), 1
    if scheme == "3d":
        q = round(P ** (1 / 3))
        return (q, q) if q ** 3 == P else (P ** (1 / 3), P ** (1 / 3))
    for q in range(math.isqrt(P // 2), 1, -1):
        if P % (q * q) == 0 and P // (q * q) >= 2:
            return q, P // (q * q)
    raise ValueError(f"grid_of: no q x q x d grid (d >= 2) has {P} ranks.")


def _sum_over(sizes: tuple[float, ...]) -> float:
    """Bytes sent per byte for a gradient summed over each axis in turn (one all-reduce per axis)."""
    return sum(2 * (n - 1) / n for n in sizes)


def comm_bytes(scheme: str, dims: BlockDims, q: float, d: float = 1, itemsize: int = 4) -> float:
    """Bytes one rank sends for one block's forward and backward (the module doc's formulas)."""
    M, C = dims.M, dims.C
    if scheme == "1d":
        return 8 * (q - 1) / q * M * C * itemsize
    KN, Kin = sum(k * n for k, n in dims.linears()), sum(dims.inputs())
    biases = sum(n for _, n in dims.linears()) if dims.bias else 0
    stats = 2 if dims.layernorm else 1
    if scheme == "3d":
        Nout = sum(n for _, n in dims.linears())
        rows = q * q
        moved = 2 * (q - 1) / q ** 3 * (M * Kin + KN + M * Nout)
        summed = (biases / q + 2 * dims.norm_params() * C / q) * _sum_over((q, q))
    else:
        rows, batch = q * d, ((d, q) if d > 1 else (q,))
        moved = 2 * (q - 1) / (rows * q) * M * Kin + 2 * (q - 1) / q ** 2 * KN
        moved += 2 * (d - 1) / d * KN / q ** 2  # 2.5D: weights' gradients summed over dep
        summed = (biases / q + 2 * dims.norm_params() * C / q) * _sum_over(batch)
    norms = 2 * stats * 2 * 2 * (q - 1) / q * M / rows  # 2 norms, each statistic all-reduced both ways
    return (moved + summed + norms) * itemsize


def param_bytes(scheme: str, dims: BlockDims, q: float, d: float = 1, itemsize: int = 4) -> float:
    """One rank's share of the block's params."""
    lin = dims.linears()
    KN, C = sum(k * n for k, n in lin), dims.C
    norms = 2 * dims.norm_params() * C
    if scheme == "1d":  # column-parallel biases split, the two row-parallel ones and the norms whole
        bias = (sum(n for _, n in lin) - 2 * C) / q + 2 * C if dims.bias else 0
        return (KN / q + bias + norms) * itemsize
    bias = sum(n for _, n in lin) / q if dims.bias else 0
    return (KN / (q ** 3 if scheme == "3d" else q * q) + bias + norms / q) * itemsize


def activation_bytes(scheme: str, dims: BlockDims, q: float, d: float = 1, itemsize: int = 4) -> float:
    """One rank's share of the block's input ``(B, T, C)`` (the residual stream between blocks)."""
    split = {"1d": 1, "2d": q * q, "2.5d": d * q * q, "3d": q ** 3}[scheme]
    return dims.M * dims.C / split * itemsize


def peers(scheme: str, q: float, d: float = 1) -> tuple[float, float]:
    """``(distinct ranks a rank talks to, the largest group of one collective minus itself)``."""
    if scheme == "1d":
        return q - 1, q - 1
    if scheme == "2d":
        return 2 * (q - 1), q - 1
    if scheme == "2.5d":
        return 2 * (q - 1) + (d - 1), max(q, d) - 1
    return 3 * (q - 1), q - 1


def table(dims: BlockDims, Ps: tuple[int, ...] = (8, 64, 1000), itemsize: int = 4) -> list[dict]:
    """Every scheme at every ``P``, from the formulas: one dict per (P, scheme)."""
    out = []
    for P in Ps:
        for s in SCHEMES:
            q, d = grid_of(s, P)
            distinct, group = peers(s, q, d)
            out.append(dict(P=P, scheme=s, q=q, d=d, exact=float(q).is_integer(), peers=distinct, group=group,
                            comm=comm_bytes(s, dims, q, d, itemsize), params=param_bytes(s, dims, q, d, itemsize),
                            acts=activation_bytes(s, dims, q, d, itemsize)))
    return out
