"""OPT (Zhang et al., 2022) as a pure function over a params pytree.

Params: ``{"wte": {"w"}, "wpe": {"w"}, "project_in"?, "blocks": [TransformerBlock params, ...],
"ln_f"?, "project_out"?, "lm_head"?}``:

* ``wte`` ``(V, E)`` with ``E = word_embed_proj_dim``; when ``E != hidden_size`` (OPT-350m)
  ``project_in`` ``(E, C)`` lifts the token embeddings into the blocks' width and
  ``project_out`` ``(C, E)`` brings the last block's output back (both without bias);
* ``wpe`` ``(max_position_embeddings + 2, C)``: OPT's learned positions are offset by 2 (the
  first two rows are HF's legacy padding rows), so position ``p`` reads row ``p + 2``;
* pre-LN (``do_layer_norm_before=True``, every size but 350m) has a final ``ln_f``; post-LN
  (350m) puts each block's norms after its residual sums and has no final norm;
* the LM head is tied to ``wte`` (``logits = x @ wte.T``) unless ``tie_embeddings=False``.

Positions: without ``mask`` token ``t`` sits at position ``t`` (so right padding needs no mask:
causal attention never lets real tokens see trailing padding). With ``mask`` (bool ``(B, T)``,
True = real token) positions count the real tokens, ``cumsum(mask) - 1``, as HF derives them from
``attention_mask``, so left-padded batches give HF's logits too; padding sits at position -1 (row 1).
Under sequence parallelism positions are the split's own; a ``mask`` is refused there.

Logical axes: as GPT-2 (``vocab``, ``embed``, ``positions``, ``heads``, ``mlp``), plus
``embed_proj`` for the ``E`` dims of a projected embedding. Weights convert to and from Hugging
Face ``OPTForCausalLM`` with ``cfx.models.to_hf`` / ``from_hf``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from cfx._src.models.common import DecoderLM, config_from_preset, dropout_keys, init_blocks
from cfx._src.models.parts import ModelParts
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.sequence import WholeSequence
from cfx._src.nn.vocab import TokenLoss

POSITION_OFFSET = 2  # position p reads row p + 2 of wpe (HF OPTLearnedPositionalEmbedding)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")  # every released OPT uses relu
EMBEDDING_SIDE = ("wte", "wpe", "project_in")  # the top-level params before the blocks
TO_HF_ACT = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
HF_EPS = 1e-5  # HF's OPT LayerNorms keep PyTorch's default eps; its config has no field for it

OPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, hidden_size=128, ffn_dim=512, max_position_embeddings=256),
    "125m": dict(n_layer=12, n_head=12, hidden_size=768, ffn_dim=3072),
    "350m": dict(n_layer=24, n_head=16, hidden_size=1024, ffn_dim=4096, word_embed_proj_dim=512,
                 do_layer_norm_before=False),
    "1.3b": dict(n_layer=24, n_head=32, hidden_size=2048, ffn_dim=8192),
    "2.7b": dict(n_layer=32, n_head=32, hidden_size=2560, ffn_dim=10240),
    "6.7b": dict(n_layer=32, n_head=32, hidden_size=4096, ffn_dim=16384),
}


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    """OPT hyperparameters (defaults: OPT-125m's shape). ``word_embed_proj_dim=None`` means
    ``hidden_size`` (no projection). ``dropout`` applies to both residual branches (OPT drops
    neither the embeddings nor, in released configs, the attention probabilities).
    ``pad_token_id``: the embedding row that, as HF's ``padding_idx``, gets no
    gradient from lookups (None: no such row)."""

    vocab_size: int = 50272
    hidden_size: int = 768
    n_layer: int = 12
    n_head: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    activation: str = "relu"
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    pad_token_id: int | None = 1
    init_std: float = 0.02

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        for name in ("vocab_size", "hidden_size", "n_layer", "n_head", "ffn_dim", "max_position_embeddings",
                     "word_embed_proj_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"OPTConfig: {name} must be a positive int, got {v!r}.")
        if self.hidden_size % self.n_head:
            raise ValueError(f"OPTConfig: hidden_size={self.hidden_size} must be divisible by n_head={self.n_head}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"OPTConfig: activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"OPTConfig: dropout must be in [0, 1), got {self.dropout!r}.")
        pad = self.pad_token_id
        if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < self.vocab_size):
            raise ValueError(f"OPTConfig: pad_token_id must be None or an id in [0, vocab_size={self.vocab_size}), "
                             f"got {pad!r}.")

    @property
    def projects(self) -> bool:
        """Whether the embeddings are narrower than the blocks (``project_in`` / ``project_out``)."""
        return self.word_embed_proj_dim != self.hidden_size

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "OPTConfig":
        """A named size (``tiny``, ``125m``, ``350m``, ``1.3b``, ``2.7b``, ``6.7b``) with field overrides."""
        return config_from_preset(cls, OPT_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class OPT(DecoderLM):
    """The OPT decoder. ``blocks`` defaults to ``n_layer`` ``TransformerBlock``s (ReLU MLP,
    biases, pre- or post-LN as ``do_layer_norm_before`` says)."""

    config: OPTConfig
    blocks: tuple = None
    layers: tuple = ()       # (name, layer) pairs replacing sublayers (``DecoderLM.with_layers``)
    max_len_name = "max_position_embeddings"

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.hidden_size, c.n_head, c.ffn_dim, activation=c.activation, norm="layernorm",
            norm_eps=c.layer_norm_eps, bias=True, dropout=c.dropout, init_std=c.init_std,
            post_norm=not c.do_layer_norm_before), c.n_layer)

    def _build_layers(self) -> dict:
        c = self.config
        C, E, std = c.hidden_size, c.word_embed_proj_dim, c.init_std
        e_axis = "embed_proj" if c.projects else "embed"
        layers = {"wte": Embedding(c.vocab_size, E, axes_names=("vocab", e_axis), init_std=std),
                  "wpe": Embedding(c.max_position_embeddings + POSITION_OFFSET, C,
                                   axes_names=("positions", "embed"), init_std=std)}
        if c.projects:
            layers["project_in"] = Linear(E, C, bias=False, axes_names=("embed_proj", "embed"), init_std=std)
        if c.do_layer_norm_before:
            layers["ln_f"] = LayerNorm(C, eps=c.layer_norm_eps)
        if c.projects:
            layers["project_out"] = Linear(C, E, bias=False, axes_names=("embed", "embed_proj"), init_std=std)
        if not c.tie_embeddings:
            layers["lm_head"] = Linear(E, c.vocab_size, bias=False, axes_names=(e_axis, "vocab"), init_std=std)
        layers["loss"], layers["sequence"] = TokenLoss(), WholeSequence()
        return layers

    def _param_layers(self) -> dict:
        """The sublayers with params, in init's order (the loss and the sequence have none)."""
        return {n: layer for n, layer in self._layers().items() if n not in ("loss", "sequence", "vocab_pad")}

    def _tree(self, blocks: Any, leaf: Any) -> dict:
        """``{name: leaf(name, layer)}`` in init's / axes' order: the embedding side, ``blocks``, the rest."""
        layers = self._param_layers()
        out = {n: leaf(n, layer) for n, layer in layers.items() if n in EMBEDDING_SIDE}
        out["blocks"] = blocks
        out.update({n: leaf(n, layer) for n, layer in layers.items() if n not in EMBEDDING_SIDE})
        return out

    def init(self, key: torch.Tensor) -> dict:
        k_blocks, *k_layers = split_keys(key, 1 + len(self._param_layers()))
        keys = dict(zip(self._param_layers(), k_layers))
        # (HF starts the padding_idx row at zero; here it is drawn like the others, so that
        # cfx.init_sharded builds it leaf by leaf: weights loaded from HF carry HF's row)
        return self._tree(init_blocks(self.blocks, k_blocks),
                          lambda name, layer: layer.init(keys[name]))

    def apply(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
              key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache: Any = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for int tokens ``(B, T)``; ``key=None`` means no dropout.

        ``mask`` (bool ``(B, T)``, True = real token) hides padded keys and numbers the positions
        by real tokens (module doc), so left padding gives HF's logits; ``positions`` (int
        ``(B, T)``) overrides that. ``cache`` (a ``cfx.nn.KVCache``): decode after the cached
        positions (``cfx.generate``).
        """
        x = self.hidden(params, tokens, mask=mask, key=key, positions=positions, cache=cache)  # (B, T, C)
        return self.logits(params, x)  # (B, T, V) or (B, T, V/n)

    def hidden(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
               key: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cache: Any = None) -> torch.Tensor:
        """``apply`` up to the last block's output ``(B, T, C)``, before the head."""
        c = self.config
        self.check_call("OPT.apply", params, tokens, mask, cache)
        if mask is not None and self._layers()["sequence"].axis is not None:
            raise ValueError("OPT.apply: a padding mask under sequence parallelism: OPT numbers positions by the "
                             "real tokens over the whole sequence, which one rank's share cannot count. Right-pad "
                             "and pass mask=None (causal attention keeps trailing padding out of the real tokens), "
                             "or split the batch instead of the sequence.")
        x = self._embed(params, tokens, mask, positions)  # (B, T, C)
        return self.run_blocks(params["blocks"], x, mask=mask, keys=dropout_keys(key, c.dropout, len(self.blocks)),
                               cache=cache)  # (B, T, C)

    def _embed(self, params: dict, tokens: torch.Tensor, mask: torch.Tensor | None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        # tokens (B, T) -> (B, T, C)
        layers, pad = self._layers(), self.config.pad_token_id
        x = self.embed(layers["wte"], params["wte"], tokens)  # (B, T, E)
        if pad is not None:  # HF's padding_idx: lookups of the pad row pass no gradient to it
            x = torch.where((tokens == pad)[..., None], x.detach(), x)
        if "project_in" in layers:
            x = layers["project_in"].apply(params["project_in"], x)  # (B, T, C)
        table = params["wpe"]["w"]  # (P + 2, C)
        if positions is not None:
            return x + F.embedding(positions + POSITION_OFFSET, table)  # + (B, T, C)
        if mask is None:
            return x + self.position_rows(table[POSITION_OFFSET:], tokens.shape[1])  # + (T, C)
        positions = mask.long().cumsum(1) * mask - 1  # (B, T): 0, 1, ... over real tokens, -1 on padding
        return x + F.embedding(positions + POSITION_OFFSET, table)  # + (B, T, C)

    def _head_parts(self, params: dict, x: torch.Tensor) -> tuple:
        # the last block's output (B, T, C) -> [ln_f] [project_out]; the head is lm_head or the tied wte
        layers = self._layers()
        if "ln_f" in layers:
            x = layers["ln_f"].apply(params["ln_f"], x)
        if "project_out" in layers:
            x = layers["project_out"].apply(params["project_out"], x)  # (B, T, E)
        name = "lm_head" if "lm_head" in layers else "wte"
        return x, layers[name], params[name]

    def parts(self) -> ModelParts:
        """Embeddings (wte, project_in where there is one, wpe) | blocks | ln_f and project_out where there
        are, the head + loss (dropout off, no padding mask: positions 0..T-1)."""
        names = tuple(self._param_layers())
        first = tuple(n for n in names if n in EMBEDDING_SIDE)
        last = tuple(n for n in names if n not in EMBEDDING_SIDE)
        if self.config.tie_embeddings:
            last += ("wte",)

        def embed(params: dict, tokens: torch.Tensor) -> torch.Tensor:
            return self._embed(params, tokens, None)  # (B, T) -> (B, T, C)

        return ModelParts(first, last, embed, self.head_loss, lambda x, y: self.check_batch("OPT stage", x, y),
                          self.config.hidden_size)

    def hf_config(self) -> Any:
        """The ``transformers.OPTConfig`` of this architecture (attention dropout and layerdrop off, as in cfx)."""
        import transformers

        config = self.config
        if config.layer_norm_eps != HF_EPS:
            raise ValueError(f"cfx.models.hf_config: HF's OPT LayerNorms use eps={HF_EPS}, and this model has "
                             f"layer_norm_eps={config.layer_norm_eps}; build it with layer_norm_eps={HF_EPS} to "
                             "exchange weights with transformers.")
        special = min(2, config.vocab_size - 1)
        return transformers.OPTConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.n_layer,
            ffn_dim=config.ffn_dim, max_position_embeddings=config.max_position_embeddings,
            do_layer_norm_before=config.do_layer_norm_before, word_embed_proj_dim=config.word_embed_proj_dim,
            dropout=config.dropout, attention_dropout=0.0, num_attention_heads=config.n_head,
            activation_function=TO_HF_ACT[config.activation], layerdrop=0.0, init_std=config.init_std,
            pad_token_id=config.pad_token_id, bos_token_id=special, eos_token_id=special, enable_bias=True,
            layer_norm_elementwise_affine=True, tie_word_embeddings=config.tie_embeddings)

    def axes(self) -> dict:
        return self._tree([b.axes() for b in self.blocks], lambda name, layer: layer.axes())


def opt(preset: str = "tiny", **overrides: Any) -> OPT:
    """``OPT(OPTConfig.preset(preset, **overrides))``."""
    return OPT(OPTConfig.preset(preset, **overrides))
