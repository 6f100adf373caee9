"""BERT (Devlin et al., 2019) as a pure function over a params pytree: a post-norm encoder with
padding masks, a masked-LM head or a sequence-classification head.

Params: ``{"wte", "wpe", "wtt" (token types), "ln_e", "blocks": [...], "mlm": {"dense", "ln", "b"}}``
(``head="mlm"``: the decoder is tied to ``wte``, with its own bias ``b``) or ``{..., "pooler",
"classifier"}`` (``head="classify"``: ``tanh(pooler(x[:, 0]))`` then a linear classifier).
Weights convert to and from Hugging Face ``BertForMaskedLM`` / ``BertForSequenceClassification``
with ``cfx.models.to_hf`` / ``from_hf``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random
from cfx._src.models.common import (DecoderLM, _check_int_2d, check_inputs, check_params, check_targets,
                                     config_from_preset, dropout_keys, init_blocks)
from cfx._src.models.parts import ModelParts
from cfx._src.nn.loss import cross_entropy
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.dropout import dropout
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.mlp import activation
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.sequence import WholeSequence
from cfx._src.nn.vocab import TokenLoss
from cfx._src.transforms.shapes import is_abstract

BERT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, hidden_size=128, intermediate_size=512),
    "base": dict(n_layer=12, n_head=12, hidden_size=768, intermediate_size=3072),    # 110M
    "large": dict(n_layer=24, n_head=16, hidden_size=1024, intermediate_size=4096),  # 340M
}
HEADS = ("mlm", "classify")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyperparameters (defaults: bert-base-uncased). ``dropout`` is HF's
    ``hidden_dropout_prob`` (embeddings, both residual branches, the classifier's input);
    attention probabilities are not dropped. ``head``: ``"mlm"`` or ``"classify"`` (with
    ``num_labels`` classes)."""

    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_size: int = 768
    n_layer: int = 12
    n_head: int = 12
    intermediate_size: int = 3072
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    head: str = "mlm"
    num_labels: int = 2

    def __post_init__(self):
        for name in ("vocab_size", "max_position_embeddings", "type_vocab_size", "hidden_size", "n_layer",
                     "n_head", "intermediate_size", "num_labels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"BertConfig: {name} must be a positive int, got {v!r}.")
        if self.hidden_size % self.n_head:
            raise ValueError(f"BertConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"n_head={self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BertConfig: dropout must be in [0, 1), got {self.dropout!r}.")
        if self.head not in HEADS:
            raise ValueError(f"BertConfig: head must be one of {HEADS}, got {self.head!r}.")
        if self.head == "classify" and self.num_labels < 2:
            raise ValueError(f"BertConfig: head='classify' needs num_labels >= 2 (cross-entropy over "
                             f"classes), got {self.num_labels}; regression heads are not implemented.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "BertConfig":
        """A named size (``tiny``, ``base``, ``large``) with field overrides."""
        return config_from_preset(cls, BERT_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class Bert(DecoderLM):
    """The BERT encoder and its head. ``blocks`` defaults to ``n_layer`` post-norm, bidirectional
    ``TransformerBlock``s (exact-erf GELU)."""

    config: BertConfig
    blocks: tuple = None
    layers: tuple = ()       # (name, layer) pairs replacing sublayers (``DecoderLM.with_layers``)
    max_len_name = "max_position_embeddings"

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.hidden_size, c.n_head, c.intermediate_size, activation="gelu", norm="layernorm",
            norm_eps=c.layer_norm_eps, bias=True, dropout=c.dropout, init_std=c.init_std, causal=False,
            post_norm=True), c.n_layer)

    def _build_layers(self) -> dict:
        c = self.config
        C, std = c.hidden_size, c.init_std
        layers = {
            "wte": Embedding(c.vocab_size, C, init_std=std),
            "wpe": Embedding(c.max_position_embeddings, C, axes_names=("positions", "embed"), init_std=std),
            "wtt": Embedding(c.type_vocab_size, C, axes_names=("token_types", "embed"), init_std=std),
            "ln_e": LayerNorm(C, eps=c.layer_norm_eps),
            "sequence": WholeSequence(),
        }
        if c.head == "mlm":
            layers["mlm_dense"] = Linear(C, C, axes_names=("embed", "embed_out"), init_std=std)
            layers["mlm_ln"] = LayerNorm(C, eps=c.layer_norm_eps)
            layers["loss"] = TokenLoss()  # the MLM's, over the vocabulary (the classifier's is its own)
        else:
            layers["pooler"] = Linear(C, C, axes_names=("embed", "embed_out"), init_std=std)
            layers["classifier"] = Linear(C, c.num_labels, axes_names=("embed", "labels"), init_std=std)
        return layers

    @property
    def _head_names(self) -> tuple[str, ...]:
        return ("mlm",) if self.config.head == "mlm" else ("pooler", "classifier")

    def init(self, key: torch.Tensor) -> dict:
        layers, c = self._layers(), self.config
        k_wte, k_wpe, k_wtt, k_blocks, k_head = split_keys(key, 5)
        params = {"wte": layers["wte"].init(k_wte), "wpe": layers["wpe"].init(k_wpe),
                  "wtt": layers["wtt"].init(k_wtt), "ln_e": layers["ln_e"].init(None),
                  "blocks": init_blocks(self.blocks, k_blocks)}
        if c.head == "mlm":
            params["mlm"] = {"dense": layers["mlm_dense"].init(k_head), "ln": layers["mlm_ln"].init(None),
                             "b": torch.zeros(c.vocab_size)}
        else:
            k_pool, k_cls = split_keys(k_head, 2)
            params["pooler"] = layers["pooler"].init(k_pool)
            params["classifier"] = layers["classifier"].init(k_cls)
        return params

    # -- forward -----------------------------------------------------------------------------
    def encode(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
               token_types: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's output ``(B, T, C)`` (every position, padding included)."""
        c = self.config
        check_inputs(f"{type(self).__name__}.apply", tokens, mask, vocab_size=self.real_vocab_size,
                     max_len=c.max_position_embeddings, max_len_name="max_position_embeddings")
        self._check_token_types(tokens, token_types)
        check_params(f"{type(self).__name__}.apply", self, params)
        keys = dropout_keys(key, c.dropout, 1 + len(self.blocks))
        x = dropout(self._embed(params, tokens, token_types), c.dropout, keys[0])  # (B, T, C)
        return self.run_blocks(params["blocks"], x, mask=mask, keys=keys[1:])

    def apply(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None,
              token_types: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
        """MLM logits ``(B, T, vocab_size)`` (this rank's ``(B, T, V/n)`` under a vocabulary split), or
        class logits ``(B, num_labels)``. ``mask``: bool ``(B, T)``, True = real token (padded keys
        are hidden from every query); ``token_types``: ``(B, T)`` segment ids (default 0);
        ``key=None`` means no dropout."""
        x = self.encode(params, tokens, mask=mask, token_types=token_types, key=key)
        k_head = None if key is None or self.config.dropout == 0.0 else random.fold_in(key, 1 << 20)
        logits = self._head(params, x, k_head)
        if self.config.head == "classify":  # every rank: the [CLS] token's (a split sequence's rank 0)
            logits = self._layers()["sequence"].from_first(logits)
        return logits

    def loss(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *,
             mask: torch.Tensor | None = None, token_types: torch.Tensor | None = None,
             key: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy (fp32). MLM: ``targets (B, T)``, the original token at masked
        positions and -100 elsewhere; classify: ``targets (B,)`` class ids."""
        where = f"{type(self).__name__}.loss"
        _check_int_2d(where, "tokens", tokens)
        self._check_targets(where, tokens, targets)
        x = self.encode(params, tokens, mask=mask, token_types=token_types, key=key)
        k_head = None if key is None or self.config.dropout == 0.0 else random.fold_in(key, 1 << 20)
        return self._loss(self._head(params, x, k_head), targets)

    def _embed(self, params: dict, tokens: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        layers, T = self._layers(), tokens.shape[1]
        x = self.embed(layers["wte"], params["wte"], tokens) + self.position_rows(params["wpe"]["w"], T)  # (B, T, C)
        x = x + (params["wtt"]["w"][0] if token_types is None else layers["wtt"].apply(params["wtt"], token_types))
        return layers["ln_e"].apply(params["ln_e"], x)

    def _head(self, params: dict, x: torch.Tensor, key: torch.Tensor | None) -> torch.Tensor:
        layers, c = self._layers(), self.config
        if c.head == "mlm":  # (B, T, C) -> (B, T, V)
            p = params["mlm"]
            h = activation("gelu", layers["mlm_dense"].apply(p["dense"], x))
            h = layers["mlm_ln"].apply(p["ln"], h)
            return self.mask_padding(layers["wte"].attend(params["wte"], h) + p["b"])
        pooled = torch.tanh(layers["pooler"].apply(params["pooler"], x[:, 0]))  # (B, C): the [CLS] token
        return layers["classifier"].apply(params["classifier"], dropout(pooled, c.dropout, key))  # (B, L)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.config.head == "mlm":
            return self.logits_loss(logits, targets)
        loss = cross_entropy(logits[:, None, :], targets[:, None])  # (B, 1, L) against (B, 1)
        # sequence split: rank 0 holds the [CLS] token; its loss counts once (the others add 0),
        # so each rank's gradient is its share, as for the MLM's tokens
        return self._layers()["sequence"].from_first(loss)

    # -- checks --------------------------------------------------------------------------------
    def _check_token_types(self, tokens: torch.Tensor, token_types: Any) -> None:
        if token_types is None:
            return
        where = f"{type(self).__name__}.apply"
        _check_int_2d(where, "token_types", token_types)
        if token_types.shape != tokens.shape:
            raise ValueError(f"{where}: token_types shape {tuple(token_types.shape)} differs from tokens shape "
                             f"{tuple(tokens.shape)}.")
        n = self.config.type_vocab_size
        if not is_abstract(token_types) and (int(token_types.min()) < 0 or int(token_types.max()) >= n):
            raise ValueError(f"{where}: token_types must lie in [0, type_vocab_size={n}), got "
                             f"[{int(token_types.min())}, {int(token_types.max())}].")

    def _check_targets(self, where: str, tokens: torch.Tensor, targets: Any) -> None:
        c = self.config
        if c.head == "mlm":
            check_targets(where, tokens, targets, vocab_size=self.real_vocab_size)
            return
        B = tokens.shape[0]
        if (not isinstance(targets, torch.Tensor) or targets.dtype in (torch.bool,) or targets.is_floating_point()
                or tuple(targets.shape) != (B,)):
            got = f"shape {tuple(targets.shape)} {targets.dtype}" if isinstance(targets, torch.Tensor) else \
                type(targets).__name__
            raise ValueError(f"{where}: a classification head takes integer targets (B,) = ({B},), one class id "
                             f"per sequence, got {got}.")
        if not is_abstract(targets) and (int(targets.min()) < 0 or int(targets.max()) >= c.num_labels):
            raise ValueError(f"{where}: class ids must lie in [0, num_labels={c.num_labels}), got "
                             f"[{int(targets.min())}, {int(targets.max())}].")

    def check_batch(self, where: str, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        c = self.config
        check_inputs(where, tokens, None, vocab_size=self.real_vocab_size, max_len=c.max_position_embeddings,
                     max_len_name="max_position_embeddings")
        self._check_targets(where, tokens, targets)

    # -- protocols -----------------------------------------------------------------------------
    def parts(self) -> ModelParts:
        """Embeddings (wte + wpe + token type 0, LayerNorm) | blocks | the head + loss (dropout
        off, no padding mask: pipeline stages run unpadded batches)."""
        def embed(params: dict, tokens: torch.Tensor) -> torch.Tensor:
            return self._embed(params, tokens, None)  # (B, T) -> (B, T, C)

        def head_loss(params: dict, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self._loss(self._head(params, x, None), targets)

        last = ("mlm", "wte") if self.config.head == "mlm" else self._head_names
        return ModelParts(("wte", "wpe", "wtt", "ln_e"), last, embed, head_loss,
                          lambda x, y: self.check_batch("Bert stage", x, y), self.config.hidden_size)

    def hf_config(self) -> Any:
        """The ``transformers.BertConfig`` of this architecture (attention dropout off, as in cfx)."""
        import transformers

        config = self.config
        return transformers.BertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.n_layer,
            num_attention_heads=config.n_head, intermediate_size=config.intermediate_size, hidden_act="gelu",
            hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=0.0,
            max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
            initializer_range=config.init_std, layer_norm_eps=config.layer_norm_eps,
            num_labels=config.num_labels, pad_token_id=0, tie_word_embeddings=True)

    def axes(self) -> dict:
        layers = self._layers()
        out = {n: layers[n].axes() for n in ("wte", "wpe", "wtt", "ln_e")}
        out["blocks"] = [b.axes() for b in self.blocks]
        if self.config.head == "mlm":
            out["mlm"] = {"dense": layers["mlm_dense"].axes(), "ln": layers["mlm_ln"].axes(), "b": ("vocab",)}
        else:
            out["pooler"] = layers["pooler"].axes()
            out["classifier"] = layers["classifier"].axes()
        return out


def bert(preset: str = "tiny", **overrides: Any) -> Bert:
    """``Bert(BertConfig.preset(preset, **overrides))``."""
    return Bert(BertConfig.preset(preset, **overrides))
