"""Megatron-LM 1D tensor parallelism (Shoeybi et al., 2019) as a layer transform.

With the rules ``{"heads": axis, "kv_heads": axis, "mlp": axis}`` each rank holds a column slice
of q/k/v and fc/gate/up and the matching row slice of o and proj/down. A block then needs
exactly two collective points per sub-layer, Megatron's ``f`` and ``g``:

    h = pvary(norm(x), axis)            # f: identity forward, all-reduce of the input grad backward
    y = psum(local_part(h) @ w_o, axis) # g: all-reduce forward, identity backward
    x = x + y + b_o                     # the row-parallel bias is added once, after the sum

so a block issues 2 all-reduces of ``B*T*C`` elements in forward and 2 in backward. The model
itself is unchanged: ``tensor_parallel(model, axis)`` wraps each block.

Megatron sequence parallelism (Korthikanti et al., 2022; ``sequence=True``): between the points
the activations are split along the sequence over the same axis, so the norms, dropouts and
residual sums (and the embeddings and head) hold ``T/n`` positions per rank. ``f`` becomes an
all-gather along the sequence and ``g`` a reduce-scatter along it: the same bytes on the wire as
the all-reduce they replace (an all-reduce is a reduce-scatter then an all-gather).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random
from cfx._src.lax import collectives as lax
from cfx._src.nn.dropout import dropout
from cfx._src.nn.linear import split_keys
from cfx._src.nn.vocab import split_sequence_layers, vocab_parallel_layers
from cfx._src.precision.quant import QuantizedWeight
from cfx._src.models.parts import hook, sequence_part
from cfx_kernels.int8_matmul import int8_matmul

MEGATRON_RULES = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}




@dataclasses.dataclass(frozen=True)
class TensorParallelBlock:
    """A ``TransformerBlock`` whose attention heads and MLP hidden units are split over ``axis``.

    Same ``init`` / ``axes`` as the wrapped block (params are global; shard them with the rules);
    ``apply`` must run inside ``shard_map`` with the block's params sharded by those rules.
    """

    block: Any
    axis: str = "model"
    sequence: bool = False  # Megatron-SP: activations split along the sequence between the points

    def __post_init__(self):
        object.__setattr__(self, "_local_by_n", {})  # axis size -> the local sublayers

    def init(self, key: torch.Tensor) -> dict:
        return self.block.init(key)

    def axes(self) -> dict:
        return self.block.axes()

    def check(self, n: int) -> None:
        """ValueError unless the block's heads, kv heads and MLP hidden units split ``n`` ways."""
        layers = self.block._layers()
        attn, mlp = layers["attn"], layers["mlp"]
        for what, size in (("n_heads", attn.n_heads), ("n_kv_heads", attn.kv_heads), ("mlp hidden", mlp.hidden)):
            if size % n:
                raise ValueError(f"tensor parallelism over axis {self.axis!r} of size {n}: the block's "
                                 f"{what}={size} is not divisible by {n}; use a mesh axis size dividing it.")

    def _local_layers(self, n: int) -> dict:
        """The block's sublayers as one rank of ``n`` runs them (made once per ``n``; made afresh
        while torch.compile traces, which would otherwise guard on the cache's contents and
        recompile once it fills -- torch 2.11 does)."""
        compiling = torch.compiler.is_dynamo_compiling()
        local = None if compiling else self._local_by_n.get(n)
        if local is None:
            self.check(n)
            layers = self.block._layers()
            attn, mlp = layers["attn"], layers["mlp"]
            local = {**layers,
                     "attn": dataclasses.replace(attn, n_heads=attn.n_heads // n,
                                                 n_kv_heads=attn.kv_heads // n, head_dim=attn.dim),
                     "mlp": dataclasses.replace(mlp, hidden=mlp.hidden // n)}
            if not compiling:
                self._local_by_n[n] = local
        return local

    def apply(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, key: torch.Tensor | None = None,
              cache=None) -> torch.Tensor:
        # x (B, T, C) replicated over the axis -> (B, T, C) replicated; ``cache``: this rank's heads'
        if self.sequence and cache is not None:
            raise ValueError("tensor_parallel(sequence=True) with a KV cache: decode with the plain tensor-parallel "
                             "model (sequence=False).")
        layers = self._local_layers(lax.axis_size(self.axis))
        attn, mlp, rate = layers["attn"], layers["mlp"], self.block.dropout
        k_attn = k_mlp = None
        if key is not None and rate > 0.0:
            if self.sequence:  # each rank's own positions: its own dropout masks
                key = random.fold_in(key, lax.axis_index(self.axis))
            k_attn, k_mlp = split_keys(key, 2)  # else the same keys on every rank of the axis
        if self.sequence and mask is not None:
            mask = lax.all_gather(mask, self.axis, dim=1, tiled=True)  # (B, T): attention sees every key
        post = self.block.post_norm  # BERT: each norm after its residual sum, not before the sub-layer
        norm1, norm2 = (lambda x, n=n: layers[n].apply(params[n], x) for n in ("norm1", "norm2"))
        h = self._f(x if post else norm1(x))
        h = attn.heads(params["attn"], h, mask=mask, positions=positions, cache=cache)  # (B, T, H/n * D)
        x = x + dropout(self._g(h, params["attn"]["o"]), rate, k_attn)
        x = norm1(x) if post else x
        h = self._f(x if post else norm2(x))
        h = mlp.hidden_out(params["mlp"], h)  # (B, T, hidden/n)
        x = x + dropout(self._g(h, params["mlp"][mlp.out_name]), rate, k_mlp)
        return norm2(x) if post else x

    def _f(self, h: torch.Tensor) -> torch.Tensor:
        """Into the split region: identity (its transpose all-reduces), or under Megatron-SP the
        all-gather of the sequence, (B, T/n, C) -> (B, T, C)."""
        if self.sequence:
            return lax.all_gather(h, self.axis, dim=1, tiled=True)
        return lax.pvary(h, self.axis)

    def _g(self, h: torch.Tensor, p: dict) -> torch.Tensor:
        """Out of it: (..., in/n) @ (in/n, out) summed over the axis (under Megatron-SP summed and
        split along the sequence, (B, T, C) -> (B, T/n, C)), then the replicated bias once."""
        w = p["w"]
        y = int8_matmul(h, w.q, w.scale) if isinstance(w, QuantizedWeight) else h @ w  # (B, T, C) partial sums
        y = lax.psum_scatter(y, self.axis, dim=1, tiled=True) if self.sequence else lax.psum(y, self.axis)
        return y + p["b"] if "b" in p else y


def tensor_parallel(model: Any, axis: str = "model", *, vocab: bool | None = None, sequence: bool = False) -> Any:
    """``model`` with every block made Megatron tensor-parallel over ``axis`` and, with ``vocab``
    (the default without ``sequence``), the embedding, LM head and loss vocab-parallel (rules
    must then map ``"vocab"`` to ``axis``; ``apply`` returns this rank's logits shard and ``loss``
    combines the shards).

    ``sequence=True``: Megatron sequence parallelism (module doc). Tokens, targets and masks are
    split along the sequence over ``axis`` (contiguously, ``P(None, axis)``); the embeddings and
    head are replicated (``vocab`` must stay off) and run on each rank's positions; the loss is
    the mean over every rank's tokens. Gradients of the leaves replicated over ``axis`` are each
    rank's positions' share: sum them with ``cfx.parallel.sequence_grads``.

    The vocabulary split replaces the model's vocabulary layers -- its tables, heads and token loss --
    with their split forms (``cfx._src.nn.vocab``, through ``model.with_layers``); a model without a
    token loss (``cfx.models.ViT``, a classifying Bert) has no vocabulary, and only its blocks split.
    A model whose blocks are not ``TransformerBlock`` s provides its own split as
    ``model.tensor_parallel(axis)`` (``cfx.diffusion.Denoiser``: the UNet's resnets and transformers)."""
    own = hook(model, "tensor_parallel")
    if callable(own):  # a model whose blocks are not TransformerBlocks splits itself (cfx.diffusion.Denoiser)
        if sequence:
            raise ValueError(f"tensor_parallel(sequence=True): {type(model).__name__} has no sequence to split "
                             "(Megatron-SP); use sequence=False.")
        return own(axis)
    if any(getattr(b, "moe", None) is not None for b in getattr(model, "blocks", ())):
        raise ValueError("tensor_parallel: the model's blocks are mixtures of experts, whose experts Megatron's "
                         "split does not cover yet; split them over an expert axis instead "
                         "(cfx.parallel.expert_parallel).")
    layers = model.sublayers() if callable(getattr(model, "sublayers", None)) else {}
    name = type(model).__name__
    # its vocabulary's split forms; none: the blocks alone split (refused for tables without a token loss)
    vocab_layers = vocab_parallel_layers(layers, axis) if vocab or (vocab is None and not sequence) else {}
    has_vocab = bool(vocab_layers)
    vocab = has_vocab if vocab is None else vocab
    if vocab and not has_vocab:
        raise ValueError(f"tensor_parallel(vocab=True): {name} has no vocabulary to split; leave vocab= at its "
                         "default (its blocks alone are split).")
    if sequence and sequence_part(model) is None:
        raise ValueError(f"tensor_parallel(sequence=True): {name} cannot split its sequence (it has no \"sequence\" "
                         "sublayer); use sequence=False.")
    if sequence and vocab:
        raise ValueError("tensor_parallel(sequence=True): the head runs on each rank's share of the positions with "
                         "the whole vocabulary; pass vocab=False (and no 'vocab' rule).")
    tp = model.map_blocks(lambda b: TensorParallelBlock(b, axis, sequence))
    if sequence:
        from cfx._src.parallel.sequence import SequenceSplit
        return tp.with_layers(**split_sequence_layers(layers, SequenceSplit(axis, "megatron", "contiguous")))
    return tp.with_layers(**vocab_layers) if vocab else tp
