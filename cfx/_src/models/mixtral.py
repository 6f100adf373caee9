"""A Mixtral-style sparse decoder (Jiang et al., 2024): Llama's attention (RMSNorm, RoPE, GQA) with
a mixture of SwiGLU experts (``cfx.nn.MoE``, top-2 of 8 in Mixtral 8x7B) in each block's MLP place.

Params as Llama's, with each block's ``mlp`` the experts' ``{"router", "gate", "up", "down"}``.
``loss`` adds ``router_aux_loss_coef`` times the load-balancing loss over all layers (as
transformers' ``MixtralForCausalLM`` does with ``output_router_logits=True``) and
``router_z_loss_coef`` times the router z-loss; ``router_stats`` returns the routing (how many
rows each expert got, per layer). Where the batch's rows are split over mesh axes (``stats_axes``:
data and expert parallelism) the statistics are summed over them first, so the auxiliary losses
are the whole batch's, as on one device. Weights convert to and from Hugging Face ``MixtralForCausalLM``.

``router_aux_group_size=S`` is the other rule, the one a pipeline can run (its stages see one
microbatch, and only their own layers): the batch's tokens, batch row by batch row, form consecutive
groups of ``S``; each layer's load-balancing and z-losses are computed over each group and averaged
over the groups and the layers (Megatron-Core and DeepSpeed compute them per layer and per
microbatch). Every rank holding whole groups computes its own groups' terms, without a collective,
and a pipeline stage adds its own layers' into each microbatch's loss (``parts().block_loss``), so
any plan equals one device running the same groups. The z-loss is the same under both rules; the
load balance is not (a product of sums, per group and per layer instead of over all of them).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cfx._src.lax import collectives as lax
from cfx._src.models.common import _check_int_2d, check_targets, config_from_preset
from cfx._src.models.llama import Llama, LlamaConfig
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.moe import MoE, RouterStats, load_balancing_loss, z_loss
from cfx._src.remat.chained import take_chain_runner

MIXTRAL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=32000, hidden_size=128, intermediate_size=256, n_layer=2, n_head=4, n_kv_heads=2,
                 n_experts=4, top_k=2, max_position_embeddings=1024),
    "8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, n_layer=32, n_head=32,
                 n_kv_heads=8, n_experts=8, top_k=2, rope_theta=1e6, rms_norm_eps=1e-5,
                 max_position_embeddings=32768),
}


# The fields transformers' MixtralConfig has no name for; an HF directory keeps them as ``cfx_<field>``
# (transformers keeps unknown keys in config.json), so a training rule survives save_pretrained.
CFX_ONLY_FIELDS = ("router_z_loss_coef", "capacity_factor", "capacity_group_size", "router_aux_group_size")


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Llama's fields and the experts': ``n_experts``, ``top_k``, the auxiliary losses' weights and
    an optional ``capacity_factor`` (None: dropless) and ``capacity_group_size`` (tokens per group, each
    with its own capacity: ``cfx.nn.MoE(group_size=...)``, which a split batch needs);
    ``router_aux_group_size`` (tokens per group: the auxiliary losses per group and layer, averaged;
    module doc), which a pipeline needs for them (None: over the whole batch and all layers at once)."""

    n_experts: int = 8
    top_k: int = 2
    router_aux_loss_coef: float = 0.02
    router_z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    capacity_group_size: int | None = None
    router_aux_group_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_experts, int) or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MixtralConfig: need 1 <= top_k <= n_experts, got top_k={self.top_k}, "
                             f"n_experts={self.n_experts}.")
        S = self.router_aux_group_size
        if S is not None and not (isinstance(S, int) and not isinstance(S, bool) and S >= 1):
            raise ValueError(f"MixtralConfig: router_aux_group_size must be a positive number of tokens (or None: the "
                             f"auxiliary losses over the whole batch), got {S!r}.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "MixtralConfig":
        """A named size (``tiny``, ``8x7b``) with field overrides."""
        return config_from_preset(cls, MIXTRAL_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class Mixtral(Llama):
    """The Mixtral decoder. ``blocks`` defaults to ``n_layer`` ``TransformerBlock``s with ``moe``."""

    config: MixtralConfig
    stats_axes: tuple = ()  # the mesh axes the batch's rows are split over (``expert_parallel``, a Plan)

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.hidden_size, c.n_head, c.intermediate_size, n_kv_heads=c.n_kv_heads, norm="rmsnorm",
            norm_eps=c.rms_norm_eps, bias=False, rope=True, rope_theta=c.rope_theta, init_std=c.init_std,
            moe=MoE(c.hidden_size, c.intermediate_size, c.n_experts, top_k=c.top_k,
                    capacity_factor=c.capacity_factor, group_size=c.capacity_group_size,
                    init_std=c.init_std)), c.n_layer)

    def router_stats(self, params: dict, tokens: torch.Tensor, *, mask: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, list[RouterStats]]:
        """The last block's output ``(B, T, C)`` and each layer's ``RouterStats`` (per group of
        ``router_aux_group_size`` tokens where it is set)."""
        self.check_call("Mixtral.apply", params, tokens, mask)
        self._check_stats_blocks()
        self.check_groups(tuple(tokens.shape), "Mixtral.router_stats")
        x, stats = self._embed(params, tokens), []  # (B, T, C)
        for block, p in zip(self.blocks, params["blocks"]):
            x, s = block.apply_with_stats(p, x, mask=mask, **self._grouping())
            stats.append(s)
        return x, stats

    def loss(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *,
             mask: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy (``Llama.loss``) plus the routers' auxiliary losses over all layers (or
        per group and layer, averaged: ``router_aux_group_size``). Every position counts in the load balance
        (transformers without an attention mask)."""
        del key
        c = self.config
        if take_chain_runner() is not None or self._layers()["sequence"].axis is not None:
            raise ValueError("Mixtral.loss: remat=auto schedules and sequence parallelism do not carry the routers' "
                             "statistics yet; train Mixtral with data / expert / tensor parallelism, ZeRO and "
                             "remat=blocks.")
        where = "Mixtral.loss"
        _check_int_2d(where, "tokens", tokens)
        check_targets(where, tokens, targets, vocab_size=c.vocab_size)
        x, stats = self.router_stats(params, tokens, mask=mask)
        loss = self.head_loss(params, x, targets)
        if not (c.router_aux_loss_coef or c.router_z_loss_coef):
            return loss
        if c.router_aux_group_size is not None:  # each rank's own groups (module doc): no collective
            return loss + sum(self._layer_aux(s) for s in stats)
        total = sum(stats[1:], stats[0])
        if self.stats_axes:  # the whole batch's routing, as one device sees it
            total = total.psum(self.stats_axes)
        aux = c.router_aux_loss_coef * load_balancing_loss(total) + c.router_z_loss_coef * z_loss(total)
        # ``loss`` is this rank's rows' (it varies over the batch's axes), ``aux`` the whole batch's (it
        # does not): JAX pvarys it where the two meet, so the transpose sums every rank's cotangent into
        # it -- without that a gradient taken on each rank and then averaged over them (a Plan's) would
        # get 1/n of the auxiliary term's
        return loss + (lax.pvary(aux, self.stats_axes) if self.stats_axes else aux)

    def parts(self) -> Any:
        """Llama's parts protocol, each microbatch's shape checked against the groups; with an auxiliary
        loss the blocks add their layers' terms (``block_loss``), which needs ``router_aux_group_size``."""
        c = self.config
        parts = dataclasses.replace(super().parts(), check_microbatch=lambda shape: self.check_groups(
            shape, "Mixtral (a pipeline microbatch)"))
        if not (c.router_aux_loss_coef or c.router_z_loss_coef):
            return parts
        if c.router_aux_group_size is None:
            raise ValueError("Mixtral: a pipeline cannot compute the auxiliary losses over the whole batch (no stage "
                             "sees it: the stages run microbatches, each of its own layers); set "
                             "router_aux_group_size=S (MixtralConfig; python -m cfx.train: --preset "
                             "tiny,router_aux_group_size=S) to compute them per group of S tokens and per layer, "
                             "averaged, as Megatron-Core and DeepSpeed do per microbatch (S dividing each rank's "
                             "microbatch tokens, e.g. the sequence length), or train with router_aux_loss_coef=0 "
                             "and router_z_loss_coef=0, or without the pipe axis.")
        self._check_stats_blocks()
        return dataclasses.replace(parts, block_loss=self._block_loss)

    def check_groups(self, shape: tuple, where: str) -> None:
        """ValueError unless a call on inputs of ``shape`` (``(B, T)``) holds whole groups, capacity's and
        the auxiliary losses': checked on every rank alike, before any collective."""
        c, n = self.config, math.prod(shape)
        for name in ("capacity_group_size", "router_aux_group_size"):
            S = getattr(c, name)
            if S is not None and n % S:
                raise ValueError(f"{where}: its {n} tokens (shape {tuple(shape)}) do not form whole groups of "
                                 f"{name}={S}; use a group size dividing the tokens of each rank's batch (and "
                                 "pipeline microbatch), e.g. the sequence length, or a batch they divide.")

    def _check_stats_blocks(self) -> None:
        plain = [type(b).__name__ for b in self.blocks if not hasattr(type(b), "apply_with_stats")]
        if plain:
            raise ValueError(f"Mixtral: blocks of type {plain[0]} do not return the routers' statistics "
                             "(apply_with_stats); wrap blocks with cfx.zero.gathered or cfx.remat, which do.")

    def _grouping(self) -> dict:
        """What asks the blocks for their statistics per group (``router_aux_group_size``), if anything."""
        S = self.config.router_aux_group_size
        return {} if S is None else {"stats_group_size": S}

    def _layer_aux(self, stats: RouterStats) -> torch.Tensor:
        """One layer's share of the grouped auxiliary losses (module doc): its groups' mean, over the layers."""
        c = self.config
        per_group = c.router_aux_loss_coef * load_balancing_loss(stats) + c.router_z_loss_coef * z_loss(stats)
        return per_group.mean() / len(self.blocks)

    def _block_loss(self, block: Any, params: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline stage's block (``ModelParts.block_loss``): its output and its layer's auxiliary term."""
        y, stats = block.apply_with_stats(params, x, mask=None, **self._grouping())
        return y, self._layer_aux(stats)

    def hf_config(self) -> Any:
        """The ``transformers.MixtralConfig`` of this architecture."""
        import transformers

        c = self.config
        if int(transformers.__version__.split(".")[0]) >= 5:  # 5.x: RoPE settings live in rope_parameters
            rope = {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
        else:
            rope = {"rope_theta": c.rope_theta}
        return transformers.MixtralConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_embeddings, **rope,
            num_local_experts=c.n_experts, num_experts_per_tok=c.top_k,
            router_aux_loss_coef=c.router_aux_loss_coef, router_jitter_noise=0.0, sliding_window=None,
            initializer_range=c.init_std, bos_token_id=min(1, c.vocab_size - 1),
            eos_token_id=min(2, c.vocab_size - 1),
            **{f"cfx_{k}": getattr(c, k) for k in CFX_ONLY_FIELDS if getattr(c, k) is not None})


def mixtral(preset: str = "tiny", **overrides: Any) -> Mixtral:
    """``Mixtral(MixtralConfig.preset(preset, **overrides))``."""
    return Mixtral(MixtralConfig.preset(preset, **overrides))
