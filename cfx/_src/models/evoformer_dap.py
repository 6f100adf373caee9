"""Dynamic Axial Parallelism (FastFold; Cheng et al., 2022) for the Evoformer over one mesh axis.

``dap(model, axis="axial")`` returns the Evoformer to run inside ``shard_map`` with the MSA split
by sequences and the pair representation by rows over ``axis`` (N ranks)::

    m          (..., S/N, R, c_m)     in_specs P(..., axis, None, None)
    z          (..., R/N, R, c_z)     P(..., axis, None, None)
    msa_mask   (..., S/N, R)          pair_mask (..., R/N, R)

Every op computes on the axis it does not attend or reduce over; the representation switches
axes with one ``all_to_all`` where the attended axis changes, and only what an op needs whole is
gathered. Per block:

=====================================  ==============================  =============================
op                                     runs on                         collectives
=====================================  ==============================  =============================
MSA row attention (pair bias)          m by sequences                  all_gather of the bias (H, R, R)
MSA column attention, MSA transition   m by residues                   all_to_all m (sequences -> residues)
outer product mean                     z rows = m's residues           all_gather of b (S, R, c_opm)
                                                                       all_to_all m back to sequences
triangle update, outgoing              z by rows                       all_gather of b (R, R, c_mul)
triangle update, incoming              z by columns                    all_to_all z, all_gather of a
triangle attention, starting node      z by rows                       all_to_all z, all_gather of bias
triangle attention, ending node,       z by columns                    all_to_all z, all_gather of bias,
pair transition                                                        all_to_all z back to rows
=====================================  ==============================  =============================

Two all-to-alls of m and four of z per block, each of a rank's whole share (it keeps 1/N of it),
and six gathers of one block each (``comm_bytes`` is the formula). The collectives
are ``cfx.lax``'s, so backward runs as their transposes and the params' gradients sum over the
axis; the same model composes with data parallelism over a leading batch dim. The masks are laid
out once per call (their own small all-to-all and gather).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from cfx._src.lax import collectives as lax
from cfx._src.models.evoformer import Evoformer, EvoformerBlock
from cfx._src.models.evoformer_layers import mask_of
from cfx._src.nn.linear import split_keys


class DAPMasks(NamedTuple):
    """A call's masks in each layout the block's ops use (None: no mask)."""

    msa_rows: torch.Tensor | None    # (..., S/N, R): this rank's sequences
    msa_cols: torch.Tensor | None    # (..., S, R/N): this rank's residues
    msa_full: torch.Tensor | None    # (..., S, R)
    pair_rows: torch.Tensor | None   # (..., R/N, R)
    pair_cols: torch.Tensor | None   # (..., R, R/N)


@dataclasses.dataclass(frozen=True)
class DAPBlock:
    """An ``EvoformerBlock`` run with DAP over ``axis`` (module doc); same ``init`` / ``axes``."""

    block: EvoformerBlock
    axis: str

    def init(self, key: torch.Tensor) -> dict:
        return self.block.init(key)

    def axes(self) -> dict:
        return self.block.axes()

    def apply(self, p: dict, x: tuple, *, msa_mask: DAPMasks | None = None, pair_mask: Any = None,
              chunk_size: int | None = None, key: Any = None) -> tuple:
        del pair_mask, key  # the masks arrive laid out (DAPMasks) as msa_mask
        masks = msa_mask if msa_mask is not None else DAPMasks(None, None, None, None, None)
        m, z = x
        L, ax = self.block.layers, self.axis
        gather = lambda t, dim: lax.all_gather(t, ax, dim=dim, tiled=True)  # noqa: E731
        # MSA by sequences: row attention, biased by every row of the pair
        row, q = L["row_att"], p["row_att"]
        m = m + row.attend(q, m, gather(row.pair_bias(q, z), -2), masks.msa_rows, chunk_size)
        # MSA by residues: column attention, transition, the outer product mean's rows
        mc = lax.all_to_all(m, ax, split_dim=-2, concat_dim=-3)
        mc = mc + L["col_att"].apply(p["col_att"], mc, masks.msa_cols, chunk_size)
        mc = mc + L["msa_transition"].apply(p["msa_transition"], mc, chunk_size)
        opm, q = L["outer_product_mean"], p["outer_product_mean"]
        a, b = opm.project(q, mc, masks.msa_cols)
        z = z + opm.combine(q, a, gather(b, -2), masks.msa_cols, masks.msa_full, chunk_size)
        m = lax.all_to_all(mc, ax, split_dim=-3, concat_dim=-2)
        # pair by rows: outgoing triangle update (every row j of b)
        tri, q = L["tri_mul_out"], p["tri_mul_out"]
        zn, a, b = tri.project(q, z, masks.pair_rows)
        z = z + tri.combine(q, zn, a, gather(b, -3), chunk_size)
        # by columns: incoming (every column i of a)
        zc = lax.all_to_all(z, ax, split_dim=-2, concat_dim=-3)
        tri, q = L["tri_mul_in"], p["tri_mul_in"]
        zn, a, b = tri.project(q, zc, masks.pair_cols)
        zc = zc + tri.combine(q, zn, gather(a, -2), b, chunk_size)
        # by rows: starting-node attention
        z = lax.all_to_all(zc, ax, split_dim=-3, concat_dim=-2)
        att, q = L["tri_att_start"], p["tri_att_start"]
        zn = att.normed(q, z)
        z = z + att.attend(q, zn, gather(att.pair_bias(q, zn), -2), masks.pair_rows, chunk_size)
        # by columns: ending-node attention (rows of the transposed pair), pair transition
        zc = lax.all_to_all(z, ax, split_dim=-2, concat_dim=-3)
        att, q = L["tri_att_end"], p["tri_att_end"]
        zn = att.normed(q, zc)
        cols_t = None if masks.pair_cols is None else masks.pair_cols.transpose(-1, -2)
        zc = zc + att.attend(q, zn, gather(att.pair_bias(q, zn), -2), cols_t, chunk_size).transpose(-2, -3)
        zc = zc + L["pair_transition"].apply(p["pair_transition"], zc, chunk_size)
        return m, lax.all_to_all(zc, ax, split_dim=-3, concat_dim=-2)


@dataclasses.dataclass(frozen=True)
class DAPEvoformer:
    """``model`` run with DAP over ``axis`` inside ``shard_map`` (module doc): ``apply(params, m, z,
    msa_mask=, pair_mask=, chunk_size=)`` on this rank's shards, returning its shards."""

    model: Evoformer
    axis: str = "axial"
    blocks: tuple = None

    def __post_init__(self):
        if self.blocks is None:
            object.__setattr__(self, "blocks", tuple(DAPBlock(b, self.axis) for b in self.model.blocks))

    @property
    def config(self):
        return self.model.config

    def init(self, key: torch.Tensor) -> dict:
        return {"blocks": [b.init(k) for b, k in zip(self.blocks, split_keys(key, len(self.blocks)))]}

    def axes(self) -> dict:
        return self.model.axes()

    def map_blocks(self, f: Callable[[Any], Any]) -> "DAPEvoformer":
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def check_inputs(self, m: torch.Tensor, z: torch.Tensor, msa_mask: Any, pair_mask: Any) -> None:
        """ValueError on every rank, before any collective, for shards that do not fit together."""
        n, c, where = lax.axis_size(self.axis), self.config, f"cfx.parallel.dap(axis={self.axis!r})"
        if not (isinstance(m, torch.Tensor) and m.dim() >= 3 and m.shape[-1] == c.c_m):
            raise ValueError(f"{where}: this rank's m must be (..., S/{n}, R, c_m={c.c_m}), got "
                             f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}.")
        if not (isinstance(z, torch.Tensor) and z.dim() >= 3 and z.shape[-1] == c.c_z):
            raise ValueError(f"{where}: this rank's z must be (..., R/{n}, R, c_z={c.c_z}), got "
                             f"{tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__}.")
        R = m.shape[-2]
        if z.shape[-2] != R:
            raise ValueError(f"{where}: the MSA has {R} residues but the pair representation {z.shape[-2]} "
                             f"(m shard {tuple(m.shape)}, z shard {tuple(z.shape)}); they must match.")
        if R % n or z.shape[-3] * n != R:
            raise ValueError(f"{where}: {R} residues do not split into {n} row blocks of the pair (this rank "
                             f"holds {z.shape[-3]} rows); shard z's rows with P({self.axis!r}) over a residue "
                             f"count divisible by {n} (pad the residues and mask them).")
        mask_of(msa_mask, tuple(m.shape[:-1]), "msa_mask (this rank's sequences)")
        mask_of(pair_mask, tuple(z.shape[:-1]), "pair_mask (this rank's rows)")

    def masks(self, msa_mask: torch.Tensor | None, pair_mask: torch.Tensor | None) -> DAPMasks:
        """The masks in every layout (floats on the wire: gloo moves no bools)."""
        ax = self.axis

        def moved(t, fn):
            return None if t is None else fn(t.to(torch.float32)) > 0.5
        msa = None if msa_mask is None else msa_mask.bool()
        pair = None if pair_mask is None else pair_mask.bool()
        return DAPMasks(
            msa, moved(msa, lambda t: lax.all_to_all(t, ax, split_dim=-1, concat_dim=-2)),
            moved(msa, lambda t: lax.all_gather(t, ax, dim=-2, tiled=True)),
            pair, moved(pair, lambda t: lax.all_to_all(t, ax, split_dim=-1, concat_dim=-2)))

    def apply(self, params: dict, m: torch.Tensor, z: torch.Tensor, *, msa_mask: torch.Tensor | None = None,
              pair_mask: torch.Tensor | None = None, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_inputs(m, z, msa_mask, pair_mask)
        masks = self.masks(msa_mask, pair_mask)
        x = (m, z)
        for block, p in zip(self.blocks, params["blocks"]):
            x = block.apply(p, x, msa_mask=masks, chunk_size=chunk_size)
        return x


def dap(model: Evoformer, axis: str = "axial") -> DAPEvoformer:
    """``model`` with Dynamic Axial Parallelism over ``axis`` (module doc)."""
    if not isinstance(model, Evoformer):
        raise ValueError(f"cfx.parallel.dap: expected a cfx.models.evoformer model, got {type(model).__name__}.")
    return DAPEvoformer(model, axis)


def comm_bytes(config, S: int, R: int, n: int, *, batch: int = 1, itemsize: int = 4) -> dict[str, int]:
    """The payload one rank contributes per block under DAP on ``n`` ranks, as ``cfx.comm_stats``
    counts it (the formula the bench checks): ``all_to_all`` -- its whole share, twice of m and
    four times of z; ``all_gather`` -- its block of each gathered tensor: the row-attention bias
    (H_msa, R, R), the outer product's b (S, R, c_opm), the triangle updates' b and a (R, R, c_mul
    each) and the two triangle-attention biases (H_pair, R, R), each split n ways."""
    c = config
    m_share, z_share = S * R * c.c_m // n, R * R * c.c_z // n
    gathered = (c.n_heads_msa * R * R + S * R * c.c_hidden_opm + 2 * R * R * c.c_hidden_mul
                + 2 * c.n_heads_pair * R * R) // n
    return {"all_to_all": batch * itemsize * (2 * m_share + 4 * z_share), "all_gather": batch * itemsize * gathered}
