"""Sequence parallelism as a model transform: ``sequence_parallel(model, axis="seq", method=...)``.

Inside ``shard_map`` each rank of ``axis`` holds ``T/N`` positions of every sequence (tokens,
targets and padding mask split along their sequence dim). Everything position-wise -- embeddings,
norms, MLPs, the head -- runs on the local positions unchanged; only attention needs the other
ranks' positions, and ``SequenceSplit.attend`` brings them:

* ``"ring"`` (Li et al., 2021): keys and values circulate round the ring (``ring_attention``),
  memory O(T/N) per rank, the positions in zigzag order so causal work is balanced;
* ``"ulysses"`` (Jacobs et al., 2023): ``all_to_all``s turn the sequence split into a head
  split and back, each rank attending the whole sequence for ``H/N`` heads (``H`` must divide
  by N; kv heads that do not are repeated per query head first); positions contiguous;
* ``"hybrid"`` (USP, Fang & Zhao, 2024) over two axes ``(ring_axis, ulysses_axis)``: Ulysses'
  all-to-alls over the second turn each ring rank's positions into a head split, and the ring
  runs over the first on those; the sequence is split over both (``P(None, (ring_axis,
  ulysses_axis))``), zigzag over the ring axis, contiguous within it.

The model learns only where its positions are (``positions``: the global ids of the local
tokens, for learned and rotary position embeddings) and that its loss is a mean over every
rank's tokens (``cfx._src.nn.loss.mean_over_sequence``). Feed tokens, targets and masks in the layout's order:
``x[:, split.order(T)]`` (the identity for ``"contiguous"``); a per-token mean loss does not
depend on that order. A model that builds its whole sequence on every rank (a ViT's [CLS] +
patches) takes its share with ``SequenceSplit.share`` (padded, the padding masked as keys), and a
head reading one token ([CLS], position 0) counts it once with ``SequenceSplit.from_first``. Compose with tensor parallelism by applying this first:
``tensor_parallel(sequence_parallel(model), "model")``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.lax import collectives as lax
from cfx._src.nn.attention import attention
from cfx._src.parallel.ring import ring_attention, zigzag_indices
from cfx._src.models.parts import sequence_part
from cfx._src.nn.vocab import split_sequence_layers

METHODS = ("ring", "ulysses", "hybrid")  # sequence_parallel's; "megatron" comes from tensor_parallel(sequence=True)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """The sequence split over mesh ``axis``: how attention gathers it, and the positions' order."""

    axis: Any = "seq"      # a mesh axis, or for "hybrid" the pair (ring_axis, ulysses_axis)
    method: str = "ring"
    layout: str = "zigzag"

    def __post_init__(self):
        if self.method not in METHODS + ("megatron",):
            raise ValueError(f"sequence_parallel: method must be one of {METHODS}, got {self.method!r}.")
        if self.layout not in ("zigzag", "contiguous"):
            raise ValueError(f"sequence_parallel: layout must be 'zigzag' or 'contiguous', got {self.layout!r}.")
        if self.method in ("ulysses", "megatron") and self.layout != "contiguous":
            raise ValueError("sequence_parallel: ulysses attends the whole sequence in its order; use "
                             "layout='contiguous'.")
        pair = isinstance(self.axis, tuple) and len(self.axis) == 2 and all(isinstance(a, str) for a in self.axis)
        if (self.method == "hybrid") != pair or not (pair or isinstance(self.axis, str)):
            raise ValueError(f"sequence_parallel: method={self.method!r} takes "
                             f"{'a pair of mesh axes (ring_axis, ulysses_axis)' if self.method == 'hybrid' else 'one mesh axis name'}, "
                             f"got axis={self.axis!r}.")

    def order(self, length: int, n: int) -> torch.Tensor:
        """The permutation to apply to a whole sequence of ``length`` before splitting it over the
        axis of ``n`` ranks (for ``"hybrid"``: ``n`` is the ring axis's size)."""
        return zigzag_indices(length, n) if self.layout == "zigzag" else torch.arange(length)

    def positions(self, local: int, device) -> torch.Tensor:
        """The global positions ``(T/N,)`` of this rank's ``local`` tokens."""
        if self.method == "hybrid":
            ring, uly = self.axis
            n, u = lax.axis_size(ring), lax.axis_size(uly)
            mine = self.order(local * n * u, n).view(n, -1)[lax.axis_index(ring)]  # the ring rank's share
            return mine.view(u, local)[lax.axis_index(uly)].to(device)
        n, r = lax.axis_size(self.axis), lax.axis_index(self.axis)
        return self.order(local * n, n).view(n, local)[r].to(device)

    def rows(self, table: torch.Tensor, T: int) -> torch.Tensor:
        """The rows of a learned position table ``(P, C)`` for this rank's ``T`` positions."""
        return table[self.positions(T, table.device)]

    def share(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's share ``(B, T'/N, ...)`` of a whole sequence ``x (B, T, ...)`` every rank holds
        (a ViT's [CLS] + patches), in the split's order, and its key-padding mask ``(B, T'/N)``
        (True = real; None when ``T`` splits as it is): ``T`` is padded with zeros to ``T'``, a
        multiple of the ranks (of twice them for the zigzag), the padding hidden from attention."""
        B, T = x.shape[:2]
        n = lax.axis_size(self.axis)  # a hybrid's pair: the product
        step = 2 * n if self.layout == "zigzag" else n  # the zigzag: two chunks per rank
        padded = -(-T // step) * step
        pos = self.positions(padded // n, x.device)  # this rank's global positions in the padded sequence
        if padded == T:
            return x[:, pos], None
        x = torch.cat([x, x.new_zeros(B, padded - T, *x.shape[2:])], dim=1)
        return x[:, pos], (pos < T)[None, :].repeat(B, 1)

    def from_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the rank holding position 0 computed it (rank 0 of the axis, in every layout) on
        every rank: a head that reads one token ([CLS]) counts it once, each rank's gradient its share."""
        return lax.psum(t * (lax.axis_index(self.axis) == 0), self.axis)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               mask: torch.Tensor | None, impl: str) -> torch.Tensor:
        """``cfx.nn.attention`` over the whole sequence, from this rank's ``(B, T/N, heads, D)``."""
        if self.method == "megatron":  # tensor_parallel's blocks gather the sequence themselves
            raise ValueError("Megatron-SP attends inside tensor_parallel(sequence=True)'s blocks; its attention "
                             "layers take the whole sequence, not a SequenceSplit.")
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"sequence_parallel(method={self.method!r}): masks must be key-padding masks (B, T/N).")
        ring_impl = "reference" if impl == "sdpa" else impl
        if self.method == "ring":
            return ring_attention(q, k, v, self.axis, causal=causal, mask=mask, layout=self.layout, impl=ring_impl)
        if self.method == "ulysses":
            return self._ulysses(q, k, v, mask, self.axis,
                                 lambda q, k, v, m: attention(q, k, v, causal=causal, mask=m, impl=impl))
        ring, uly = self.axis  # hybrid: the ring runs over the ulysses axis's gathered positions
        return self._ulysses(q, k, v, mask, uly, lambda q, k, v, m: ring_attention(
            q, k, v, ring, causal=causal, mask=m, layout=self.layout, impl=ring_impl))

    def _ulysses(self, q, k, v, mask, axis: str, attend):
        """``attend`` on the head split of the sequence gathered over ``axis`` (Ulysses)."""
        n = lax.axis_size(axis)
        H, Hkv = q.shape[2], k.shape[2]
        if H % n:
            raise ValueError(f"sequence_parallel(method={self.method!r}): the {H} attention heads (per rank) must "
                             f"divide by the {n} ranks of axis {axis!r}; use method='ring', or a mesh axis dividing them.")
        if Hkv % n:  # grouped-query attention with fewer kv heads than ranks: each query head its own copy
            k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
        # (B, T/N, H, D) -> (B, T, H/N, D): split the heads, gather the sequence
        q, k, v = (lax.all_to_all(t, axis, split_dim=2, concat_dim=1) for t in (q, k, v))
        if mask is not None:
            mask = lax.all_gather(mask, axis, dim=1, tiled=True)  # (B, T)
        out = attend(q, k, v, mask)  # (B, T, H/N, D)
        return lax.all_to_all(out, axis, split_dim=1, concat_dim=2)  # (B, T/N, H, D)


def sequence_grads(grads: Any, specs: Any, axis: str) -> Any:
    """Each rank's gradient of a loss over its share of the positions, summed over ``axis`` where
    it is a share: the leaves ``specs`` (a ``P`` or a pytree prefix of them) replicate over
    ``axis`` (all of them under ``sequence_parallel``; the norms, biases of row-parallel layers
    and embeddings under ``tensor_parallel(sequence=True)``). One flat all-reduce."""
    from cfx._src.core import tree as tree_util
    from cfx._src.mesh.spec import P, is_spec
    from cfx._src.parallel.state import tree_psum
    items, treedef = tree_util.flatten(grads)
    if is_spec(specs):
        spec_items = [specs] * len(items)
    else:
        spec_items = tree_util.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        if len(spec_items) != len(items):
            raise ValueError(f"sequence_grads: {len(spec_items)} specs for {len(items)} gradient leaves; pass the "
                             "params' specs (or one P for all).")
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    shared = [i for i, s in enumerate(spec_items) if not set(axes) & set(s.all_axes())]
    summed = tree_psum([items[i] for i in shared], axis)
    for i, g in zip(shared, summed):
        items[i] = g
    return tree_util.unflatten(treedef, items)


def sequence_parallel(model: Any, axis: str = "seq", *, method: str = "ring", layout: str | None = None) -> Any:
    """``model`` with its sequence split over mesh ``axis`` (see the module doc; for
    ``method="hybrid"`` the pair ``(ring_axis, ulysses_axis)``). ``layout``: ``"zigzag"`` (the
    ring's and the hybrid's default) or ``"contiguous"`` (Ulysses')."""
    if method not in METHODS:
        raise ValueError(f"sequence_parallel: method must be one of {METHODS}, got {method!r} (Megatron-SP: "
                         "cfx.parallel.tensor_parallel(model, axis, sequence=True)).")
    split = SequenceSplit(tuple(axis) if isinstance(axis, list) else axis, method,
                          layout or ("contiguous" if method == "ulysses" else "zigzag"))
    if sequence_part(model) is None or not isinstance(getattr(model, "blocks", None), tuple):
        raise ValueError(f"sequence_parallel: {type(model).__name__} is not a cfx model with blocks and a "
                         "\"sequence\" sublayer (GPT2, Llama, OPT, Bert, ViT).")
    if sequence_part(model).axis is not None:
        raise ValueError(f"sequence_parallel: {type(model).__name__}'s sequence is split already (over "
                         f"{sequence_part(model).axis!r}); apply it to the plain model.")

    def split_block(block):
        if not hasattr(block, "seq") or not dataclasses.is_dataclass(block):
            raise ValueError(f"sequence_parallel: block {type(block).__name__} has no `seq` field; apply "
                             "sequence_parallel to the model first, then tensor_parallel / cfx.zero.gathered / "
                             "cfx.remat, which wrap its blocks.")
        return dataclasses.replace(block, seq=split)
    return model.map_blocks(split_block).with_layers(**split_sequence_layers(model.sublayers(), split))
