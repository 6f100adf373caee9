"""The ``UNet2DConditionModel`` config fields ``cfx.diffusion.UNet2DCondition`` implements, checked,
and read from diffusers' config (options it does not implement are refused by name)."""
from __future__ import annotations

import dataclasses
from typing import Any


DOWN_BLOCK_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCK_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCK_TYPES = ("UNetMidBlock2DCrossAttn", None)

# diffusers config fields this UNet does not implement, and the values (diffusers' defaults) it accepts
_FIXED: dict[str, tuple] = {
    "act_fn": ("silu", "swish"), "dropout": (0.0,), "mid_block_scale_factor": (1.0,),
    "only_cross_attention": (False,), "mid_block_only_cross_attention": (None, False),
    "dual_cross_attention": (False,), "num_attention_heads": (None,), "class_embed_type": (None,),
    "num_class_embeds": (None,), "addition_embed_type": (None,), "addition_time_embed_dim": (None,),
    "encoder_hid_dim": (None,), "encoder_hid_dim_type": (None,), "resnet_time_scale_shift": ("default",),
    "resnet_skip_time_act": (False,), "resnet_out_scale_factor": (1.0,), "time_embedding_type": ("positional",),
    "time_embedding_act_fn": (None,), "timestep_post_act": (None,), "time_cond_proj_dim": (None,),
    "projection_class_embeddings_input_dim": (None,), "attention_type": ("default",),
    "class_embeddings_concat": (False,), "cross_attention_norm": (None,),
    "reverse_transformer_layers_per_block": (None,),
}
_UNREAD = ("addition_embed_type_num_heads",)  # only read by options refused above


def _accepted(value: Any, allowed: tuple) -> bool:
    if isinstance(value, (list, tuple)):  # a per-block value: every block's must be accepted
        return all(_accepted(v, allowed) for v in value)
    return value in allowed


@dataclasses.dataclass(frozen=True)
class UNet2DConditionConfig:
    """The ``UNet2DConditionModel`` config fields this UNet implements (defaults: diffusers'). Per-block
    fields take an int (every block) or one value per down block. ``attention_head_dim`` is, as in
    diffusers, the number of heads (each ``channels // attention_head_dim`` wide). ``upcast_attention``
    is accepted and, as by diffusers' SDPA attention processor, not read. ``sample_size`` is only
    carried (any multiple of ``2 ** (len(block_out_channels) - 1)`` runs)."""

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    attention_head_dim: int | tuple[int, ...] = 8
    use_linear_projection: bool = False
    upcast_attention: bool = False
    time_embedding_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):  # lists (a JSON config's) -> tuples, so the config hashes
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
        n = len(self.block_out_channels)
        if not (len(self.down_block_types) == len(self.up_block_types) == n) or n == 0:
            raise ValueError(f"UNet2DConditionConfig: down_block_types ({len(self.down_block_types)}), up_block_types "
                             f"({len(self.up_block_types)}) and block_out_channels ({n}) must have one entry per "
                             "resolution, the same number each.")
        for name, types, valid in (("down_block_types", self.down_block_types, DOWN_BLOCK_TYPES),
                                   ("up_block_types", self.up_block_types, UP_BLOCK_TYPES),
                                   ("mid_block_type", (self.mid_block_type,), MID_BLOCK_TYPES)):
            bad = [t for t in types if t not in valid]
            if bad:
                raise ValueError(f"UNet2DConditionConfig: {name} {bad} not supported; use {valid}.")
        for name in ("layers_per_block", "cross_attention_dim", "transformer_layers_per_block", "attention_head_dim"):
            v = getattr(self, name)
            vals = v if isinstance(v, tuple) else (v,)
            if isinstance(v, tuple) and len(v) != n:
                raise ValueError(f"UNet2DConditionConfig: {name} has {len(v)} entries for {n} blocks; give one "
                                 "per down block, or a single int.")
            if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vals):
                raise ValueError(f"UNet2DConditionConfig: {name} must be positive ints (one per block), got {v!r}.")
        if len(set(self.per_block("cross_attention_dim"))) > 1:
            raise ValueError(f"UNet2DConditionConfig: cross_attention_dim {self.cross_attention_dim} differs between "
                             "blocks, but every block attends to the same text states; give one width.")
        g = self.norm_num_groups
        if not isinstance(g, int) or g <= 0 or any(c % g for c in self.block_out_channels):
            raise ValueError(f"UNet2DConditionConfig: block_out_channels {self.block_out_channels} must be multiples "
                             f"of norm_num_groups={g} (GroupNorm splits every block's channels into that many groups).")
        for i, (c, h) in enumerate(zip(self.block_out_channels, self.per_block("attention_head_dim"))):
            if c % h:
                raise ValueError(f"UNet2DConditionConfig: block {i} has {c} channels, not divisible by "
                                 f"attention_head_dim={h} heads; pick a head count dividing the channels.")
        for name in ("conv_in_kernel", "conv_out_kernel"):
            k = getattr(self, name)
            if not isinstance(k, int) or k <= 0 or k % 2 == 0:
                raise ValueError(f"UNet2DConditionConfig: {name} must be an odd positive int, got {k!r}.")

    def per_block(self, name: str) -> tuple[int, ...]:
        """A per-block field as one value per down block."""
        v = getattr(self, name)
        return v if isinstance(v, tuple) else (v,) * len(self.block_out_channels)

    @property
    def temb_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    @classmethod
    def from_diffusers(cls, config: Any) -> "UNet2DConditionConfig":
        """From a ``UNet2DConditionModel`` 's config (or the model, or its ``config.json`` as a dict).
        ValueError naming the options set that this UNet does not implement."""
        c = dict(getattr(config, "config", config))
        fields = {f.name for f in dataclasses.fields(cls)}
        unsupported = {k: v for k, v in c.items() if k in _FIXED and not _accepted(v, _FIXED[k])}
        unknown = sorted(k for k in c if k not in fields and k not in _FIXED and k not in _UNREAD
                         and not k.startswith("_"))
        if unsupported or unknown:
            raise ValueError(f"UNet2DConditionConfig.from_diffusers: unsupported diffusers options {unsupported}"
                             + (f" and unknown fields {unknown}" if unknown else "")
                             + "; this UNet implements Stable Diffusion 1.x/2.x's (leave those at diffusers' "
                             f"defaults: {({k: _FIXED[k][0] for k in unsupported})}).")
        return cls(**{k: v for k, v in c.items() if k in fields})
