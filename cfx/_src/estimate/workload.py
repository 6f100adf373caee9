"""What one transformer layer asks of a GPU: its matmuls, its attention core, its memory-bound
kernels and the activations it keeps, for a microbatch on one rank of a plan.

``TransformerShape.of(model)`` reads a decoder's shape from its blocks and config (GPT-2, Llama, OPT,
Mixtral: anything whose ``blocks`` are ``TransformerBlock`` s); nothing is allocated. ``TransformerShape.gpt``
builds the GPT-3 shapes the papers tabulate.

Counting conventions (Narayanan et al. 2021, Korthikanti et al. 2022):
- model FLOPs per step ``3 x forward``, forward = ``2 x tokens x matmul params`` per layer + the
  attention core ``4 b s^2 h`` (QK^T and PV, the whole square, causal or not) + the logits ``2 b s h V``;
  for GPT this is Megatron's ``72 B s l h^2 (1 + s/6h + V/12hl)``. Hardware FLOPs add recomputation.
- activations per layer (``activation_bytes``): Korthikanti's ``s b h (34 + 5 a s / h)`` at 2-byte
  activations and 1-byte dropout masks, term by term, so tensor parallelism, Megatron-SP, a split
  sequence, a fused (flash) attention core, no dropout, a gated MLP and recomputation each change
  the terms they change.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cfx._src.models.parts import hook


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = False       # SwiGLU: three MLP matrices
    experts: int = 0          # a mixture of experts (0: dense)
    top_k: int = 1
    dropout: bool = False     # dropout masks kept for backward
    name: str = ""

    @classmethod
    def gpt(cls, hidden: int, layers: int, heads: int, vocab: int = 51200, *, dropout: bool = True,
            name: str = "") -> "TransformerShape":
        """A GPT-3-style shape (MLP of 4 h, dropout on)."""
        return cls(hidden, layers, heads, heads, 4 * hidden, vocab, dropout=dropout, name=name)

    @classmethod
    def of(cls, model: Any) -> "TransformerShape":
        """The shape of a decoder whose ``blocks`` are ``TransformerBlock`` s (each a wrapped one's
        ``.block`` read through), its vocabulary from ``config.vocab_size``."""
        blocks = getattr(model, "blocks", None)   # a ChainModel's
        config = hook(model, "config")
        if not blocks or not hasattr(config, "vocab_size"):
            raise ValueError(f"cfx.parallel.estimate: {type(model).__name__} is not a decoder with blocks and "
                             "config.vocab_size (GPT2, Llama, OPT, Mixtral); the estimate reads a transformer's shape.")
        b = blocks[0]
        while not hasattr(b, "features") and hasattr(b, "block"):
            b = b.block
        if not hasattr(b, "features"):
            raise ValueError(f"cfx.parallel.estimate: {type(model).__name__}'s blocks are {type(b).__name__}, not "
                             "TransformerBlocks; the estimate reads features / n_heads / mlp_hidden from them.")
        moe = getattr(b, "moe", None)
        return cls(hidden=b.features, layers=len(blocks), heads=b.n_heads, kv_heads=b.n_kv_heads or b.n_heads,
                   ffn=moe.hidden if moe is not None else b.mlp_hidden, vocab=config.vocab_size,
                   gated=moe is not None or b.activation == "swiglu", experts=moe.n_experts if moe else 0,
                   top_k=moe.top_k if moe else 1, dropout=b.dropout > 0, name=type(model).__name__)

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def mlp_mats(self) -> int:
        return 3 if self.gated else 2

    def layer_params(self) -> int:
        """Matmul weights of one layer (every expert's)."""
        attn = self.hidden * (self.hidden + 2 * self.kv_dim) + self.hidden * self.hidden
        return attn + self.mlp_mats * self.hidden * self.ffn * max(1, self.experts)

    def active_layer_params(self) -> int:
        """Matmul weights one token meets in a layer (``top_k`` experts of a mixture)."""
        attn = self.hidden * (self.hidden + 2 * self.kv_dim) + self.hidden * self.hidden
        return attn + self.mlp_mats * self.hidden * self.ffn * (self.top_k if self.experts else 1)

    def expert_params(self) -> int:
        """The experts' matmul weights over every layer (0 for a dense model): what an expert axis splits."""
        return self.layers * self.mlp_mats * self.hidden * self.ffn * self.experts if self.experts else 0

    def params(self) -> int:
        """About every parameter: the layers' matmuls and the embedding (biases and norms left out)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    # -- FLOPs of one forward ---------------------------------------------------------------------------
    def layer_flops(self, tokens: int, seq: int) -> tuple[float, float]:
        """``(matmul, attention core)`` FLOPs of one layer's forward on ``tokens`` tokens of ``seq`` long rows."""
        return 2.0 * tokens * self.active_layer_params(), 4.0 * tokens * seq * self.hidden

    def model_flops(self, rows: int, seq: int) -> float:
        """Model FLOPs of one training step on ``rows`` x ``seq`` tokens (module doc)."""
        mm, attn = self.layer_flops(rows * seq, seq)
        return 3.0 * (self.layers * (mm + attn) + 2.0 * rows * seq * self.hidden * self.vocab)

    # -- activations ------------------------------------------------------------------------------------
    def activation_bytes(self, b: int, s: int, *, t: int = 1, sp: bool = False, cp: int = 1, dtype: int = 2,
                         fused: bool = True, remat: str = "none") -> float:
        """Bytes one layer keeps for its backward, for ``b`` rows of ``s`` positions on one rank: tensor
        parallel over ``t``, Megatron-SP (``sp``: what lies between the matmuls split over ``t`` too), the
        sequence split over ``cp`` (ring / Ulysses), activations of ``dtype`` bytes, a fused attention core
        (``fused``: its output and log-sum-exp; else the softmax's square), ``remat`` none, dots (Megatron's
        selective recomputation: the attention core's square recomputed) or blocks (each layer's input)."""
        s = s / cp
        sbh = s * b * self.hidden
        rep = sbh / t if sp else sbh            # what lies outside the matmuls: split with SP, else whole
        if remat == "blocks":
            return dtype * rep
        mask = 1 if self.dropout else 0
        attn = dtype * (2 * rep + 3 * sbh / t + sbh / t) + mask * rep  # norm in, qkv in, q k v, proj in, mask
        attn += dtype * sbh / t * (self.kv_dim / self.hidden - 1) * 2  # grouped-query heads: smaller k, v
        heads_sq = self.heads / t * b * s * s * cp
        if not fused and remat != "dots":
            attn += (dtype + mask + (dtype if self.dropout else 0)) * heads_sq  # softmax out, mask, dropout out
        elif fused:
            attn += 4 * self.heads / t * b * s                                       # fp32 log-sum-exp
        inner = s * b * self.ffn * (self.top_k if self.experts else 1) / t
        mlp = dtype * 2 * rep + mask * rep + dtype * inner * (3 if self.gated else 2)  # norm in, fc in; act in/out
        return attn + mlp

    def fp8_cast_bytes(self, tokens: int, t: int, dtype: int, gw_hp: bool) -> tuple[float, float]:
        """HBM bytes of one layer's casts to float8 on one of ``t`` tensor-parallel ranks, forward's and
        backward's: each Linear's operands read for their amax, read again and written as one byte (a 4-byte
        master weight; ``dtype``-byte activations and gradients); backward casts the output's gradient for both
        GEMMs and the weight and the input again (``gw_hp``: the weight's gradient in high precision, one cast)."""
        linears = [(self.hidden, self.hidden), (self.hidden, self.kv_dim), (self.hidden, self.kv_dim),
                   (self.hidden, self.hidden)]
        linears += [(self.hidden, self.ffn)] * (2 if self.gated else 1) + [(self.ffn, self.hidden)]
        act, weight = 2 * dtype + 1, 2 * 4 + 1
        fwd = sum(act * tokens * i + weight * i * o for i, o in linears) / t
        bwd = sum(act * tokens * o * (1 if gw_hp else 2) + (0 if gw_hp else act * tokens * i) + weight * i * o
                  for i, o in linears) / t
        return fwd, bwd

    def memory_bound_bytes(self, b: int, s: int, *, t: int = 1, sp: bool = False, cp: int = 1, dtype: int = 2,
                           fused: bool = True) -> float:
        """HBM bytes one layer's forward moves outside its matmuls: two norms, the activation, the
        residual sums (and dropouts), the softmax's square when the attention core is not fused."""
        s = s / cp
        sbh = s * b * self.hidden
        rep = sbh / t if sp else sbh
        mask = 1 if self.dropout else 0
        inner = s * b * self.ffn * (self.top_k if self.experts else 1) / t
        out = dtype * (2 * 2 * rep + 2 * 3 * rep) + 2 * mask * rep   # norms: read+write; bias-dropout-add: 2 in, 1 out
        out += dtype * inner * (3 if self.gated else 2)               # the activation: read, write (gated: 2 in)
        if not fused:
            sq = self.heads / t * b * s * s * cp
            out += sq * (2 * dtype + (2 * dtype + mask if self.dropout else 0))  # softmax in/out; dropout
        return out
