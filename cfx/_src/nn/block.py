"""``TransformerBlock``: pre-norm ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``, or post-norm
(BERT) ``norm1(x + attn(x))`` then ``norm2(x + mlp(x))``."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.nn.attention import Attention
from cfx._src.nn.dropout import dropout
from cfx._src.nn.linear import split_keys
from cfx._src.nn.mlp import MLP
from cfx._src.nn.norm import LayerNorm, RMSNorm
from cfx._src.nn.sublayers import keep_sublayers

NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class TransformerBlock:
    """A transformer block. Params ``{"norm1", "attn", "norm2", "mlp"}``.

    GPT-2: ``norm="layernorm"``, ``activation="gelu_tanh"``, biases. Llama: ``norm="rmsnorm"``,
    ``activation="swiglu"``, ``bias=False``, ``rope=True``, ``n_kv_heads`` for GQA.
    ``dropout`` applies to both residual branches when ``apply`` gets a ``key``.
    ``out_init_std`` is the init std of the two residual projections (``attn.o``, the MLP's last).
    ``causal=False`` lets every token attend to every other (an encoder); ``post_norm=True`` puts
    each norm after its residual sum (BERT) instead of before the sub-layer (GPT-2, Llama).
    """

    features: int
    n_heads: int
    mlp_hidden: int
    n_kv_heads: int | None = None
    activation: str = "gelu_tanh"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    bias: bool = True
    rope: bool = False
    rope_theta: float = 10000.0
    dropout: float = 0.0
    init_std: float = 0.02
    out_init_std: float | None = None
    causal: bool = True
    post_norm: bool = False
    seq: Any = None  # a cfx.parallel SequenceSplit (``sequence_parallel`` sets it)
    attn_impl: str = "auto"  # cfx.nn.attention's impl: auto | sdpa | triton | reference
    moe: Any = None  # a cfx.nn.MoE in the MLP's place (Mixtral): ``apply_with_stats`` returns its router's

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"TransformerBlock: unknown norm {self.norm!r}; use one of {NORMS}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TransformerBlock: dropout must be in [0, 1), got {self.dropout!r}.")
        keep_sublayers(self, self._build_layers())

    def _layers(self) -> dict:
        return self._sublayers

    def _build_layers(self) -> dict:
        if self.norm == "layernorm":
            norm = LayerNorm(self.features, eps=self.norm_eps, bias=self.bias)
        else:
            norm = RMSNorm(self.features, eps=self.norm_eps)
        attn = Attention(self.features, self.n_heads, n_kv_heads=self.n_kv_heads, bias=self.bias,
                         rope=self.rope, rope_theta=self.rope_theta, init_std=self.init_std,
                         out_init_std=self.out_init_std, causal=self.causal, seq=self.seq,
                         impl=self.attn_impl)
        mlp = self.moe if self.moe is not None else MLP(
            self.features, self.mlp_hidden, activation=self.activation, bias=self.bias, init_std=self.init_std,
            out_init_std=self.out_init_std)
        return {"norm1": norm, "attn": attn, "norm2": norm, "mlp": mlp}

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        return {n: layer.init(k) for (n, layer), k in zip(layers.items(), split_keys(key, len(layers)))}

    def apply(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, key: torch.Tensor | None = None,
              cache=None) -> torch.Tensor:
        # x (B, T, C) -> (B, T, C); ``cache``: a KVCache layer (decoding)
        return self.apply_with_stats(params, x, mask=mask, positions=positions, key=key, cache=cache)[0]

    def apply_with_stats(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                         positions: torch.Tensor | None = None, key: torch.Tensor | None = None,
                         cache=None, stats_group_size: int | None = None) -> tuple[torch.Tensor, Any]:
        """``apply``'s output and, for a ``moe`` block, its router's ``RouterStats`` (else None), per group
        of ``stats_group_size`` tokens where given (``MoE.apply_with_stats``)."""
        layers = self._layers()
        ffn = (lambda p, h: layers["mlp"].apply_with_stats(p, h, stats_group_size=stats_group_size)) \
            if self.moe is not None else (lambda p, h: (layers["mlp"].apply(p, h), None))  # -> (out, stats)
        k_attn = k_mlp = None
        if key is not None and self.dropout > 0.0:
            k_attn, k_mlp = split_keys(key, 2)
        if self.post_norm:
            h = layers["attn"].apply(params["attn"], x, mask=mask, positions=positions, cache=cache)
            x = layers["norm1"].apply(params["norm1"], x + dropout(h, self.dropout, k_attn))
            h, stats = ffn(params["mlp"], x)
            return layers["norm2"].apply(params["norm2"], x + dropout(h, self.dropout, k_mlp)), stats
        h = layers["attn"].apply(params["attn"], layers["norm1"].apply(params["norm1"], x),
                                 mask=mask, positions=positions, cache=cache)
        x, h = layers["norm2"].add_apply(params["norm2"], x, dropout(h, self.dropout, k_attn))  # the residual
        h, stats = ffn(params["mlp"], h)  # add and the next norm in one pass (on CUDA)
        return x + dropout(h, self.dropout, k_mlp), stats

    def axes(self) -> dict:
        return {n: layer.axes() for n, layer in self._layers().items()}
