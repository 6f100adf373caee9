"""A Llama-style decoder (Touvron et al., 2023): RMSNorm, RoPE, SwiGLU, grouped-query attention.

Params: ``{"embed": {"w"}, "blocks": [...], "norm": {"scale"}, "lm_head": {"w"}}``; with
``tie_embeddings`` there is no ``lm_head`` and ``logits = x @ embed.T``. Weights convert to and
from Hugging Face ``LlamaForCausalLM`` with ``cfx.models.to_hf`` / ``from_hf``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.models.common import DecoderLM, config_from_preset, init_blocks
from cfx._src.models.parts import ModelParts
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.norm import RMSNorm
from cfx._src.nn.sequence import WholeSequence
from cfx._src.nn.vocab import TokenLoss

# Real sizes use default RoPE only: Llama 3.x's "llama3" frequency scaling is not implemented, so
# "1b" is Llama-3.2-1B's shape at its original 8192-token context.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=32000, hidden_size=128, intermediate_size=344, n_layer=4, n_head=4,
                 n_kv_heads=2, max_position_embeddings=1024),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, n_layer=16, n_head=32,
               n_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
               tie_embeddings=True),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, n_layer=32, n_head=32,
               n_kv_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layer=32, n_head=32,
               n_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyperparameters (defaults: Llama-2-7B's shape). ``n_kv_heads=None`` means ``n_head``."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    n_layer: int = 32
    n_head: int = 32
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_head)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layer", "n_head",
                     "n_kv_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {v!r}.")
        if self.hidden_size % self.n_head:
            raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"n_head={self.n_head}.")
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_head={self.n_head} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """A named size (``tiny``, ``1b``, ``7b``, ``8b``) with field overrides."""
        return config_from_preset(cls, LLAMA_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class Llama(DecoderLM):
    """The Llama decoder. ``blocks`` defaults to ``n_layer`` ``TransformerBlock``s."""

    config: LlamaConfig
    blocks: tuple = None
    layers: tuple = ()       # (name, layer) pairs replacing sublayers (``DecoderLM.with_layers``)
    max_len_name = "max_position_embeddings"

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.hidden_size, c.n_head, c.intermediate_size, n_kv_heads=c.n_kv_heads,
            activation="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps, bias=False, rope=True,
            rope_theta=c.rope_theta, init_std=c.init_std), c.n_layer)

    def _build_layers(self) -> dict:
        c = self.config
        layers = {
            "embed": Embedding(c.vocab_size, c.hidden_size, init_std=c.init_std),
            "norm": RMSNorm(c.hidden_size, eps=c.rms_norm_eps),
        }
        if not c.tie_embeddings:
            layers["lm_head"] = Linear(c.hidden_size, c.vocab_size, bias=False,
                                       axes_names=("embed", "vocab"), init_std=c.init_std)
        layers["loss"], layers["sequence"] = TokenLoss(), WholeSequence()
        return layers

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        k_embed, k_head, k_blocks = split_keys(key, 3)
        params = {
            "embed": layers["embed"].init(k_embed),
            "blocks": init_blocks(self.blocks, k_blocks),
            "norm": layers["norm"].init(None),
        }
        if "lm_head" in layers:
            params["lm_head"] = layers["lm_head"].init(k_head)
        return params

    def apply(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
              key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache: Any = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for int tokens ``(B, T)``.

        ``mask`` (bool ``(B, T)``, True = real token) hides padded keys; RoPE positions stay
        ``0..T-1`` unless ``positions`` (int ``(B, T)``) says. ``cache`` (a ``cfx.nn.KVCache``):
        decode after the cached positions (``cfx.generate``). Llama has no dropout: ``key`` is
        accepted for a uniform signature and unused.
        """
        x = self.hidden(params, tokens, mask=mask, key=key, positions=positions, cache=cache)  # (B, T, C)
        return self.logits(params, x)  # (B, T, V) or (B, T, V/n)

    def hidden(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
               key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cache: Any = None) -> torch.Tensor:
        """``apply`` up to the last block's output ``(B, T, C)``, before the head."""
        del key
        self.check_call("Llama.apply", params, tokens, mask, cache)
        x = self._embed(params, tokens)  # (B, T, C)
        return self.run_blocks(params["blocks"], x, mask=mask, keys=[None] * len(self.blocks),
                               positions=positions, cache=cache)

    def _embed(self, params: dict, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(self._layers()["embed"], params["embed"], tokens)  # (B, T) -> (B, T, C)

    def _head_parts(self, params: dict, x: torch.Tensor) -> tuple:
        # the last block's output (B, T, C) -> norm; the head is tied to the embedding, or lm_head
        layers = self._layers()
        x = layers["norm"].apply(params["norm"], x)  # (B, T, C)
        name = "embed" if self.config.tie_embeddings else "lm_head"
        return x, layers[name], params[name]

    def parts(self) -> ModelParts:
        """The embedding | blocks | norm + head (tied to the embedding or ``lm_head``) + loss."""
        tied = self.config.tie_embeddings
        return ModelParts(("embed",), ("norm", "embed" if tied else "lm_head"), self._embed,
                          self.head_loss,
                          lambda x, y: self.check_batch("Llama stage", x, y), self.config.hidden_size)

    def hf_config(self) -> Any:
        """The ``transformers.LlamaConfig`` of this architecture (default RoPE, no biases)."""
        import transformers

        config = self.config
        if int(transformers.__version__.split(".")[0]) >= 5:  # 5.x: RoPE settings live in rope_parameters
            rope = {"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
        else:
            rope = {"rope_theta": config.rope_theta}
        return transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_hidden_layers=config.n_layer,
            num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_heads,
            head_dim=config.head_dim, hidden_act="silu",
            max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False,
            initializer_range=config.init_std, bos_token_id=min(1, config.vocab_size - 1),
            eos_token_id=min(2, config.vocab_size - 1), **rope)

    def axes(self) -> dict:
        layers = self._layers()
        out = {
            "embed": layers["embed"].axes(),
            "blocks": [b.axes() for b in self.blocks],
            "norm": layers["norm"].axes(),
        }
        if "lm_head" in layers:
            out["lm_head"] = layers["lm_head"].axes()
        return out


def llama(preset: str = "tiny", **overrides: Any) -> Llama:
    """``Llama(LlamaConfig.preset(preset, **overrides))``."""
    return Llama(LlamaConfig.preset(preset, **overrides))
