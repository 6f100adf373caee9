"""GPT-2 (Radford et al., 2019) as a pure function over a params pytree.

Params: ``{"wte": {"w"}, "wpe": {"w"}, "blocks": [TransformerBlock params, ...], "ln_f": {...}}``.
The LM head is tied to ``wte`` (``logits = x @ wte.T``). Weights convert to and from Hugging
Face ``GPT2LMHeadModel`` with ``cfx.models.to_hf`` / ``from_hf``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from cfx._src.models.common import DecoderLM, config_from_preset, dropout_keys, init_blocks
from cfx._src.models.parts import ModelParts
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.dropout import dropout
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import split_keys
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.sequence import WholeSequence
from cfx._src.nn.vocab import TokenLoss

GPT2_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256),
    "small": dict(n_layer=12, n_head=12, n_embd=768),   # 124M
    "medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1558M
}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyperparameters. ``dropout`` applies to the embeddings and both residual branches."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GPT2Config: {name} must be a positive int, got {v!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd={self.n_embd} must be divisible by n_head={self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT2Config: dropout must be in [0, 1), got {self.dropout!r}.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPT2Config":
        """A named size (``tiny``, ``small``, ``medium``, ``large``, ``xl``) with field overrides."""
        return config_from_preset(cls, GPT2_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class GPT2(DecoderLM):
    """The GPT-2 decoder. ``blocks`` defaults to ``n_layer`` ``TransformerBlock``s."""

    config: GPT2Config
    blocks: tuple = None
    layers: tuple = ()       # (name, layer) pairs replacing sublayers (``DecoderLM.with_layers``)
    max_len_name = "n_positions"

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.n_embd, c.n_head, 4 * c.n_embd, activation="gelu_tanh", norm="layernorm",
            norm_eps=c.layer_norm_eps, bias=True, dropout=c.dropout, init_std=c.init_std,
            # GPT-2's scaled init of the residual projections: 2 per block.
            out_init_std=c.init_std / math.sqrt(2 * c.n_layer)), c.n_layer)

    def _build_layers(self) -> dict:
        c = self.config
        return {
            "wte": Embedding(c.vocab_size, c.n_embd, init_std=c.init_std),
            "wpe": Embedding(c.n_positions, c.n_embd, axes_names=("positions", "embed"),
                             init_std=c.init_std),
            "ln_f": LayerNorm(c.n_embd, eps=c.layer_norm_eps),
            "loss": TokenLoss(),
            "sequence": WholeSequence(),
        }

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        k_wte, k_wpe, k_blocks = split_keys(key, 3)
        return {
            "wte": layers["wte"].init(k_wte),
            "wpe": layers["wpe"].init(k_wpe),
            "blocks": init_blocks(self.blocks, k_blocks),
            "ln_f": layers["ln_f"].init(None),
        }

    def apply(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
              key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache: Any = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for int tokens ``(B, T)``; ``key=None`` means no dropout.

        ``mask`` (bool ``(B, T)``, True = real token) hides padded keys; positions stay
        ``0..T-1`` as in HF without ``position_ids``, unless ``positions`` (int ``(B, T)``) says.
        ``cache`` (a ``cfx.nn.KVCache``): decode after the cached positions (``cfx.generate``).
        """
        x = self.hidden(params, tokens, mask=mask, key=key, positions=positions, cache=cache)  # (B, T, C)
        return self.logits(params, x)  # (B, T, V) or (B, T, V/n)

    def hidden(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
               key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cache: Any = None) -> torch.Tensor:
        """``apply`` up to the last block's output ``(B, T, C)``, before the head."""
        c = self.config
        self.check_call("GPT2.apply", params, tokens, mask, cache)
        keys = dropout_keys(key, c.dropout, 1 + len(self.blocks))
        x = dropout(self._embed(params, tokens, positions), c.dropout, keys[0])  # (B, T, C)
        return self.run_blocks(params["blocks"], x, mask=mask, keys=keys[1:], cache=cache)  # (B, T, C)

    def _embed(self, params: dict, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # tokens (B, T) -> token + position embeddings (B, T, C)
        wpe = params["wpe"]["w"]  # (P, C)
        rows = self.position_rows(wpe, tokens.shape[1]) if positions is None else F.embedding(positions, wpe)
        return self.embed(self._layers()["wte"], params["wte"], tokens) + rows  # + (T | B, T, C)

    def _head_parts(self, params: dict, x: torch.Tensor) -> tuple:
        # the last block's output (B, T, C) -> ln_f; the head is the tied embedding
        layers = self._layers()
        return layers["ln_f"].apply(params["ln_f"], x), layers["wte"], params["wte"]

    def parts(self) -> ModelParts:
        """Embeddings (wte + wpe) | blocks | ln_f + the tied head + loss (dropout off)."""
        return ModelParts(("wte", "wpe"), ("ln_f", "wte"), self._embed,
                          self.head_loss,
                          lambda x, y: self.check_batch("GPT2 stage", x, y), self.config.n_embd)

    def hf_config(self) -> Any:
        """The ``transformers.GPT2Config`` of this architecture (attention dropout off, as in cfx)."""
        import transformers

        config = self.config
        special = min(50256, config.vocab_size - 1)
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
            n_layer=config.n_layer, n_head=config.n_head, n_inner=None, activation_function="gelu_new",
            resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=0.0,
            layer_norm_epsilon=config.layer_norm_eps, initializer_range=config.init_std,
            bos_token_id=special, eos_token_id=special, tie_word_embeddings=True)

    def axes(self) -> dict:
        layers = self._layers()
        return {
            "wte": layers["wte"].axes(),
            "wpe": layers["wpe"].axes(),
            "blocks": [b.axes() for b in self.blocks],
            "ln_f": layers["ln_f"].axes(),
        }


def gpt2(preset: str = "tiny", **overrides: Any) -> GPT2:
    """``GPT2(GPT2Config.preset(preset, **overrides))``."""
    return GPT2(GPT2Config.preset(preset, **overrides))
