"""The Evoformer (Jumper et al., 2021, supplementary Algorithms 6-15) as pure functions over params.

Two representations flow through every block: the MSA ``m`` ``(..., S, R, c_m)`` (S sequences of
R residues) and the pair ``z`` ``(..., R, R, c_z)``, with masks ``msa_mask`` ``(..., S, R)`` and
``pair_mask`` ``(..., R, R)`` (True or 1 = a real position). One block (Algorithm 6; no dropout)::

    m += MSARowAttentionWithPairBias(m, z)     attention along R in each sequence, biased by z
    m += MSAColumnAttention(m)                 attention along S at each residue
    m += MSATransition(m)
    z += OuterProductMean(m)
    z += TriangleMultiplicationOutgoing(z)     z_ij <- sum_k a_ik * b_jk
    z += TriangleMultiplicationIncoming(z)     z_ij <- sum_k a_ki * b_kj
    z += TriangleAttentionStartingNode(z)      row i: query j, key k, bias b_jk
    z += TriangleAttentionEndingNode(z)        column j: query i, key k, bias b_ki
    z += PairTransition(z)

Each attention is gated (``sigmoid(Linear(x))`` times the heads' outputs) and runs its softmax
through ``cfx_kernels.fused_softmax`` (logits + bias, masked keys at -1e9: a query whose keys are
all masked attends uniformly, as AlphaFold's 1e9 bias does). The outer product mean is the
masked mean ``sum_s m_si m_sj a_si (x) b_sj / (eps + sum_s m_si m_sj)`` flattened channel-major
(``a``'s channel first), then a Linear; triangle multiplications mask ``a`` and ``b`` by the pair
mask. Transitions are unmasked.

Every op is written over the trailing dims, so leading batch dims pass through, and is split into
the parts Dynamic Axial Parallelism (``cfx.parallel.dap``) runs between its collectives: the pair
bias apart from the attention it biases, the projections of the outer product and the triangle
updates apart from their contraction. ``chunk_size`` (per call) computes each op over chunks of
its independent rows (sequences, residues, pair rows) one at a time: less activation memory, the
same numbers; ``cfx.autochunk`` chooses chunks automatically.

Params per block: ``{"row_att", "col_att", "msa_transition", "outer_product_mean", "tri_mul_out",
"tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition"}``; Linear weights are
``(in, out)``; attention projections are head-major (feature ``h * c + i`` is head ``h``'s channel
``i``); the layers (``evoformer_layers``) name their own params in ``init``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from cfx._src.models.common import config_from_preset
from cfx._src.models.evoformer_layers import (MSAColumnAttention, MSARowAttention, OuterProductMean, Transition,
                                              TriangleAttention, TriangleMultiplication, mask_of)
from cfx._src.nn.linear import split_keys

EVOFORMER_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_blocks=2, c_m=32, c_z=16, c_hidden_msa_att=8, n_heads_msa=4, c_hidden_opm=8,
                 c_hidden_mul=16, c_hidden_pair_att=8, n_heads_pair=2),
    "af2": dict(n_blocks=48, c_m=256, c_z=128, c_hidden_msa_att=32, n_heads_msa=8, c_hidden_opm=32,
                c_hidden_mul=128, c_hidden_pair_att=32, n_heads_pair=4),   # AlphaFold 2's sizes
}


@dataclasses.dataclass(frozen=True)
class EvoformerConfig:
    """Evoformer sizes (defaults: AlphaFold 2's), the transitions' widening ``transition_n``, the
    LayerNorms' ``eps`` and the outer product mean's ``opm_eps``; ``softmax_impl`` is the fused
    softmax's ``impl`` (``"auto"``: Triton on CUDA)."""

    n_blocks: int = 48
    c_m: int = 256
    c_z: int = 128
    c_hidden_msa_att: int = 32
    n_heads_msa: int = 8
    c_hidden_opm: int = 32
    c_hidden_mul: int = 128
    c_hidden_pair_att: int = 32
    n_heads_pair: int = 4
    transition_n: int = 4
    eps: float = 1e-5
    opm_eps: float = 1e-3
    softmax_impl: str = "auto"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"EvoformerConfig: {f.name} must be a positive int, got {v!r}.")
        if self.softmax_impl not in ("auto", "triton", "reference"):
            raise ValueError(f"EvoformerConfig: softmax_impl must be 'auto', 'triton' or 'reference', got "
                             f"{self.softmax_impl!r}.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "EvoformerConfig":
        """A named size (``tiny``, ``af2``) with field overrides."""
        return config_from_preset(cls, EVOFORMER_PRESETS, name, overrides)


# -- the block and the stack -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EvoformerBlock:
    """Algorithm 6 (see the module doc): ``apply(p, (m, z), msa_mask=, pair_mask=, chunk_size=)``."""

    config: EvoformerConfig

    @property
    def layers(self) -> dict:
        c = self.config
        kw = dict(eps=c.eps)
        return {
            "row_att": MSARowAttention(c.c_m, c.c_z, c.c_hidden_msa_att, c.n_heads_msa, impl=c.softmax_impl, **kw),
            "col_att": MSAColumnAttention(c.c_m, c.c_hidden_msa_att, c.n_heads_msa, impl=c.softmax_impl, **kw),
            "msa_transition": Transition(c.c_m, c.transition_n, **kw),
            "outer_product_mean": OuterProductMean(c.c_m, c.c_z, c.c_hidden_opm, opm_eps=c.opm_eps, **kw),
            "tri_mul_out": TriangleMultiplication(c.c_z, c.c_hidden_mul, outgoing=True, **kw),
            "tri_mul_in": TriangleMultiplication(c.c_z, c.c_hidden_mul, outgoing=False, **kw),
            "tri_att_start": TriangleAttention(c.c_z, c.c_hidden_pair_att, c.n_heads_pair, starting=True,
                                               impl=c.softmax_impl, **kw),
            "tri_att_end": TriangleAttention(c.c_z, c.c_hidden_pair_att, c.n_heads_pair, starting=False,
                                             impl=c.softmax_impl, **kw),
            "pair_transition": Transition(c.c_z, c.transition_n, axis_name="pair_embed", **kw),
        }

    def init(self, key: torch.Tensor) -> dict:
        layers = self.layers
        return {name: layer.init(k) for (name, layer), k in zip(layers.items(), split_keys(key, len(layers)))}

    def axes(self) -> dict:
        return {name: layer.axes() for name, layer in self.layers.items()}

    def apply(self, p: dict, x: tuple, *, msa_mask: torch.Tensor | None = None,
              pair_mask: torch.Tensor | None = None, chunk_size: int | None = None, key: Any = None) -> tuple:
        del key  # no dropout
        m, z = x
        L = self.layers
        m = m + L["row_att"].apply(p["row_att"], m, z, msa_mask, chunk_size)
        m = m + L["col_att"].apply(p["col_att"], m, msa_mask, chunk_size)
        m = m + L["msa_transition"].apply(p["msa_transition"], m, chunk_size)
        z = z + L["outer_product_mean"].apply(p["outer_product_mean"], m, msa_mask, chunk_size)
        for name in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end"):
            z = z + L[name].apply(p[name], z, pair_mask, chunk_size)
        z = z + L["pair_transition"].apply(p["pair_transition"], z, chunk_size)
        return m, z


@dataclasses.dataclass(frozen=True)
class Evoformer:
    """A stack of ``n_blocks`` Evoformer blocks: ``apply(params, m, z, msa_mask=, pair_mask=,
    chunk_size=) -> (m, z)``; params ``{"blocks": [...]}``. ``blocks`` / ``map_blocks`` let layer
    transforms (``cfx.remat``, ``cfx.zero.gathered``) wrap each block."""

    config: EvoformerConfig
    blocks: tuple = None

    def __post_init__(self):
        if self.blocks is None:
            object.__setattr__(self, "blocks", (EvoformerBlock(self.config),) * self.config.n_blocks)
        elif len(self.blocks) != self.config.n_blocks:
            raise ValueError(f"Evoformer: got {len(self.blocks)} blocks for n_blocks={self.config.n_blocks}.")

    def init(self, key: torch.Tensor) -> dict:
        return {"blocks": [b.init(k) for b, k in zip(self.blocks, split_keys(key, len(self.blocks)))]}

    def axes(self) -> dict:
        return {"blocks": [b.axes() for b in self.blocks]}

    def map_blocks(self, f: Callable[[Any], Any]) -> "Evoformer":
        """A copy whose blocks are ``f(block)`` (same ``init`` / ``apply`` / ``axes``)."""
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def check_inputs(self, m: torch.Tensor, z: torch.Tensor, msa_mask: Any, pair_mask: Any) -> None:
        """ValueError (before any compute or collective) on inputs that do not fit together."""
        c = self.config
        if not (isinstance(m, torch.Tensor) and m.dim() >= 3 and m.shape[-1] == c.c_m):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"Evoformer: m must be (..., S, R, c_m={c.c_m}), got {got}.")
        if not (isinstance(z, torch.Tensor) and z.dim() >= 3 and z.shape[-1] == c.c_z and z.shape[-2] == z.shape[-3]):
            got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ValueError(f"Evoformer: z must be (..., R, R, c_z={c.c_z}), got {got}.")
        if z.shape[-2] != m.shape[-2]:
            raise ValueError(f"Evoformer: the MSA has {m.shape[-2]} residues (m {tuple(m.shape)}) but the pair "
                             f"representation {z.shape[-2]} (z {tuple(z.shape)}); they must match.")
        mask_of(msa_mask, tuple(m.shape[:-1]), "msa_mask")
        mask_of(pair_mask, tuple(z.shape[:-1]), "pair_mask")

    def apply(self, params: dict, m: torch.Tensor, z: torch.Tensor, *, msa_mask: torch.Tensor | None = None,
              pair_mask: torch.Tensor | None = None, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, z)`` after every block; masks True (or 1) at real positions."""
        self.check_inputs(m, z, msa_mask, pair_mask)
        msa_mask = mask_of(msa_mask, tuple(m.shape[:-1]), "msa_mask")
        pair_mask = mask_of(pair_mask, tuple(z.shape[:-1]), "pair_mask")
        x = (m, z)
        for block, p in zip(self.blocks, params["blocks"]):
            x = block.apply(p, x, msa_mask=msa_mask, pair_mask=pair_mask, chunk_size=chunk_size)
        return x


def evoformer(preset: str = "tiny", **overrides: Any) -> Evoformer:
    """``Evoformer(EvoformerConfig.preset(preset, **overrides))``."""
    return Evoformer(EvoformerConfig.preset(preset, **overrides))
