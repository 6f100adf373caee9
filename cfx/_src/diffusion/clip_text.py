"""The CLIP text encoder of Stable Diffusion (``transformers.CLIPTextModel``) as a pure function.

Params: ``{"wte": {"w"}, "wpe": {"w"}, "blocks": [TransformerBlock params, ...], "ln_f": {...}}``
(GPT-2's names: token and position tables, pre-LN causal blocks, a final LayerNorm).
``apply(params, tokens, mask=None)`` returns ``(last_hidden_state, pooled_output)`` as
``CLIPTextModel(input_ids, attention_mask)`` does; ``from_hf`` / ``to_hf_state_dict`` convert
weights both ways (``nn.Linear`` is ``(out, in)``, ``cfx.nn.Linear`` ``(in, out)``: transposed).

Two behaviours follow ``transformers`` exactly:

* the pooled output is the hidden state at the end-of-text token, found by transformers' rule for
  the config's ``eos_token_id``: ``2`` (the legacy configs, SD 1.x's among them) takes the argmax
  of the ids (the first of the highest id: the real ``<|endoftext|>`` is the highest id);
  any other id takes its first occurrence (position 0 if a row has none);
* ``mask`` (bool ``(B, T)``, True = real token) hides padded keys on top of the causal mask.
  A query that can see no key at all (a left-padded row's padding) gets a zero attention output;
  transformers leaves such rows undefined (its ``sdpa`` and ``eager`` paths disagree there).
  Stable Diffusion pads on the right, or passes no mask.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from cfx._src.models.common import check_inputs, check_params, config_from_preset
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import split_keys
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.sublayers import keep_sublayers

CLIP_ACTIVATIONS = ("quick_gelu", "gelu")
LEGACY_EOS_TOKEN_ID = 2  # transformers' marker of a pre-#24773 config: pool at the argmax of the ids

CLIP_TEXT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4),
    # SD 1.x: openai/clip-vit-large-patch14's text tower (123M params, its config's legacy eos id 2)
    "sd15": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                 eos_token_id=2, bos_token_id=0, pad_token_id=1),
}


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """CLIP text-tower hyperparameters (defaults: SD 1.x's). Attention dropout is not modelled:
    ``apply`` is the eval-mode forward. ``bos_token_id`` / ``pad_token_id`` only travel to and from
    the transformers config; like ``CLIPTextModel``, the forward uses ``eos_token_id`` alone."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = LEGACY_EOS_TOKEN_ID
    bos_token_id: int = 0
    pad_token_id: int = 1
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CLIPTextConfig: {name} must be a positive int, got {v!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIPTextConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"num_attention_heads={self.num_attention_heads}.")
        if self.hidden_act not in CLIP_ACTIVATIONS:
            raise ValueError(f"CLIPTextConfig: hidden_act {self.hidden_act!r} is not supported; use one of "
                             f"{CLIP_ACTIVATIONS}.")
        if not isinstance(self.eos_token_id, int) or not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"CLIPTextConfig: eos_token_id={self.eos_token_id!r} is not an id of the vocabulary "
                             f"[0, {self.vocab_size}); the pooled output is read at that token. Set it to the "
                             f"tokenizer's end-of-text id (or {LEGACY_EOS_TOKEN_ID} for the legacy argmax rule).")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "CLIPTextConfig":
        """A named size (``tiny``, ``sd15``) with field overrides."""
        return config_from_preset(cls, CLIP_TEXT_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class CLIPTextEncoder:
    """The CLIP text transformer. ``blocks`` defaults to ``num_hidden_layers`` pre-LN causal ``TransformerBlock``s."""

    config: CLIPTextConfig
    blocks: tuple = None

    def __post_init__(self):
        c = self.config
        if self.blocks is None:
            block = TransformerBlock(c.hidden_size, c.num_attention_heads, c.intermediate_size, activation=c.hidden_act,
                              norm="layernorm", norm_eps=c.layer_norm_eps, bias=True, causal=True,
                              init_std=c.init_std, out_init_std=c.init_std / math.sqrt(2 * c.num_hidden_layers))
            object.__setattr__(self, "blocks", (block,) * c.num_hidden_layers)
        elif len(self.blocks) != c.num_hidden_layers:
            raise ValueError(f"CLIPTextEncoder: got {len(self.blocks)} blocks for "
                             f"num_hidden_layers={c.num_hidden_layers}.")
        keep_sublayers(self, {
            "wte": Embedding(c.vocab_size, c.hidden_size, init_std=c.init_std),
            "wpe": Embedding(c.max_position_embeddings, c.hidden_size, axes_names=("positions", "embed"),
                             init_std=c.init_std / 2),
            "ln_f": LayerNorm(c.hidden_size, eps=c.layer_norm_eps),
        })

    def _layers(self) -> dict:
        return self._sublayers

    def map_blocks(self, f: Any) -> "CLIPTextEncoder":
        """A copy whose blocks are ``f(block)`` (same ``init`` / ``apply`` / ``axes``)."""
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        k_wte, k_wpe, k_blocks = split_keys(key, 3)
        return {
            "wte": layers["wte"].init(k_wte),
            "wpe": layers["wpe"].init(k_wpe),
            "blocks": [b.init(k) for b, k in zip(self.blocks, split_keys(k_blocks, len(self.blocks)))],
            "ln_f": layers["ln_f"].init(None),
        }

    def axes(self) -> dict:
        layers = self._layers()
        return {"wte": layers["wte"].axes(), "wpe": layers["wpe"].axes(),
                "blocks": [b.axes() for b in self.blocks], "ln_f": layers["ln_f"].axes()}

    def apply(self, params: dict, tokens: torch.Tensor, mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last_hidden_state (B, T, C), pooled_output (B, C))`` for int tokens ``(B, T)``;
        ``mask``: bool ``(B, T)``, True = real token (transformers' ``attention_mask.bool()``)."""
        c = self.config
        where = "CLIPTextEncoder.apply"
        check_inputs(where, tokens, mask, vocab_size=c.vocab_size, max_len=c.max_position_embeddings,
                     max_len_name="max_position_embeddings")
        check_params(where, self, params)
        layers = self._layers()
        T = tokens.shape[1]
        x = layers["wte"].apply(params["wte"], tokens) + params["wpe"]["w"][:T]  # (B, T, C)
        for block, p in zip(self.blocks, params["blocks"]):
            x = block.apply(p, x, mask=mask)  # causal, and padded keys hidden
        x = layers["ln_f"].apply(params["ln_f"], x)  # (B, T, C)
        rows = torch.arange(x.shape[0], device=x.device)
        return x, x[rows, self.eos_positions(tokens).to(x.device)]  # (B, T, C), (B, C)

    def eos_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Where each row is pooled, ``(B,)``: transformers' rule (``CLIPTextTransformer.forward``)."""
        ids = tokens.to(torch.int)
        if self.config.eos_token_id == LEGACY_EOS_TOKEN_ID:
            return ids.argmax(dim=-1)  # the first of the highest id
        return (ids == self.config.eos_token_id).int().argmax(dim=-1)  # its first occurrence, else 0


def clip_text(preset: str = "tiny", **overrides: Any) -> CLIPTextEncoder:
    """``CLIPTextEncoder(CLIPTextConfig.preset(preset, **overrides))``."""
    return CLIPTextEncoder(CLIPTextConfig.preset(preset, **overrides))


# --- transformers interchange ------------------------------------------------------------------

def hf_config(config: CLIPTextConfig) -> Any:
    """The ``transformers.CLIPTextConfig`` of this architecture (imports transformers)."""
    import transformers

    return transformers.CLIPTextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_act,
        layer_norm_eps=config.layer_norm_eps, attention_dropout=0.0, initializer_range=config.init_std,
        eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id)


def config_from_hf(hf: Any) -> CLIPTextConfig:
    """A ``CLIPTextConfig`` from a ``transformers.CLIPTextConfig`` (or a ``CLIPConfig``'s ``text_config``)."""
    hf = getattr(hf, "text_config", hf)
    if hf.hidden_act not in CLIP_ACTIVATIONS:
        raise ValueError(f"cfx CLIP from_hf: hidden_act={hf.hidden_act!r} is not implemented; the cfx CLIP text "
                         f"encoder supports {CLIP_ACTIVATIONS}.")

    def ids(name: str, default: int) -> int:
        v = getattr(hf, name, None)
        return default if v is None else int(v)
    return CLIPTextConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings, hidden_act=hf.hidden_act,
        layer_norm_eps=float(hf.layer_norm_eps), eos_token_id=ids("eos_token_id", LEGACY_EOS_TOKEN_ID),
        bos_token_id=ids("bos_token_id", 0), pad_token_id=ids("pad_token_id", 1),
        init_std=float(getattr(hf, "initializer_range", 0.02)))


# each block's Linears: (cfx path under the block, transformers' module under its layer)
LINEARS = (("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
           ("attn.o", "self_attn.out_proj"), ("mlp.fc", "mlp.fc1"), ("mlp.proj", "mlp.fc2"))


def hf_modules(config: CLIPTextConfig, *, prefix: str = "") -> dict[str, str]:
    """``{cfx Linear path: CLIPTextModel module}`` of every Linear (``blocks.0.attn.q`` ->
    ``encoder.layers.0.self_attn.q_proj``; ``prefix`` as ``to_hf_state_dict``'s)."""
    return {f"blocks.{i}.{ours}": f"{prefix}encoder.layers.{i}.{theirs}"
            for i in range(config.num_hidden_layers) for ours, theirs in LINEARS}


def to_hf_state_dict(encoder: CLIPTextEncoder, params: dict, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """A ``CLIPTextModel`` state dict. ``prefix=""`` is transformers 5's layout; ``"text_model."``
    that of transformers 4 and of Stable Diffusion's ``text_encoder`` checkpoints."""
    check_params("cfx CLIP to_hf_state_dict", CLIPTextEncoder(encoder.config), params)
    sd = {prefix + "embeddings.token_embedding.weight": copy(params["wte"]["w"]),
          prefix + "embeddings.position_embedding.weight": copy(params["wpe"]["w"])}

    def put(name: str, p: dict, w: str = "w", b: str = "b", transpose: bool = True):
        sd[name + ".weight"] = copy(p[w].T if transpose else p[w])
        sd[name + ".bias"] = copy(p[b])

    for i, p in enumerate(params["blocks"]):
        pre = f"{prefix}encoder.layers.{i}."
        for ours, theirs in LINEARS:
            parent, _, name = ours.partition(".")
            put(pre + theirs, p[parent][name])
        put(pre + "layer_norm1", p["norm1"], "scale", "bias", transpose=False)
        put(pre + "layer_norm2", p["norm2"], "scale", "bias", transpose=False)
    put(prefix + "final_layer_norm", params["ln_f"], "scale", "bias", transpose=False)
    return sd


def _params_from_state_dict(config: CLIPTextConfig, state_dict: Mapping[str, torch.Tensor]) -> dict:
    C, M = config.hidden_size, config.intermediate_size
    r = StateDictReader(state_dict, where="cfx CLIP from_hf", prefix="text_model.")

    def linear(name: str, n_in: int, n_out: int) -> dict:  # torch (out, in) -> cfx (in, out)
        return {"w": r.take(name + ".weight", (n_out, n_in), transpose=True), "b": r.take(name + ".bias", (n_out,))}

    def norm(name: str) -> dict:
        return {"scale": r.take(name + ".weight", (C,)), "bias": r.take(name + ".bias", (C,))}

    params = {"wte": {"w": r.take("embeddings.token_embedding.weight", (config.vocab_size, C))},
              "wpe": {"w": r.take("embeddings.position_embedding.weight", (config.max_position_embeddings, C))},
              "blocks": []}
    sizes = {**{f"attn.{n}": (C, C) for n in "qkvo"}, "mlp.fc": (C, M), "mlp.proj": (M, C)}  # (in, out)
    for i in range(config.num_hidden_layers):
        pre = f"encoder.layers.{i}."
        block = {"norm1": norm(pre + "layer_norm1"), "attn": {}, "norm2": norm(pre + "layer_norm2"), "mlp": {}}
        for ours, theirs in LINEARS:
            parent, _, name = ours.partition(".")
            block[parent][name] = linear(pre + theirs, *sizes[ours])
        params["blocks"].append(block)
    params["ln_f"] = norm("final_layer_norm")
    r.finish(ignore=lambda k: k.endswith("embeddings.position_ids"))  # a buffer older checkpoints carry
    return params


def from_hf(model_or_state_dict: Any, config: Any = None) -> tuple[CLIPTextEncoder, dict]:
    """``(encoder, params)`` from a ``transformers.CLIPTextModel`` or its state dict.

    ``config`` (a cfx ``CLIPTextConfig`` or a transformers one) defaults to the model's; a bare state
    dict needs it (the head count, activation and eos id are not in the weights)."""
    if isinstance(model_or_state_dict, Mapping):
        state_dict = model_or_state_dict
        if config is None:
            raise ValueError("cfx CLIP from_hf: a state dict carries no config; pass config= (a cfx "
                             "CLIPTextConfig such as CLIPTextConfig.preset('sd15'), or the transformers one).")
    elif hasattr(model_or_state_dict, "state_dict"):
        state_dict = model_or_state_dict.state_dict()
        if config is None:
            config = model_or_state_dict.config
    else:
        raise ValueError(f"cfx CLIP from_hf: expected a transformers CLIPTextModel or a state dict, got "
                         f"{type(model_or_state_dict).__name__}.")
    if not isinstance(config, CLIPTextConfig):
        config = config_from_hf(config)
    return CLIPTextEncoder(config), _params_from_state_dict(config, state_dict)
