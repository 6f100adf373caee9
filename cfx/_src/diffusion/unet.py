"""Stable Diffusion's UNet (diffusers' ``UNet2DConditionModel``) as a pure function over params.

One denoising call, ``apply(params, sample, timestep, encoder_hidden_states)``::

    emb = time_embedding(timestep_embedding(t))               (B, 4 C0)   sinusoidal -> Linear, SiLU, Linear
    h = conv_in(sample)                                        (B, C0, H, W)
    down blocks: [resnet -> transformer?] x layers_per_block, then a stride-2 conv; every output is a skip
    mid block:   resnet -> transformer -> resnet
    up blocks:   [cat(h, skips.pop()) -> resnet -> transformer?] x (layers_per_block + 1), then 2x upsample
    out = conv_out(SiLU(conv_norm_out(h)))                     (B, out_channels, H, W)

A transformer (``Transformer2D``) is GroupNorm -> proj_in -> ``BasicTransformerBlock`` s (self-attention,
cross-attention over the text encoder's states, GEGLU feed-forward, each pre-LayerNorm and residual) ->
proj_out, plus the input. Params are named as diffusers names its submodules (``down_blocks[0]
["attentions"][0]["transformer_blocks"][0]["attn1"]["to_q"]``), so ``from_diffusers`` /
``to_diffusers_state_dict`` only rename leaves (``weight`` <-> ``w`` / ``scale``, ``bias`` <-> ``b`` /
``bias``, ``to_out.0`` <-> ``to_out``, ``ff.net.0.proj`` / ``ff.net.2`` <-> ``ff.proj`` / ``ff.out``) and
transpose Linear weights, which cfx lays out ``(in, out)``; convs keep torch's ``(out, in, k, k)``.

The sample's height and width must be multiples of ``2 ** (len(block_out_channels) - 1)`` (diffusers
also runs other sizes, resizing each upsample to its skip; that path is not implemented). Attention
runs through ``cfx.nn.attention`` (``UNet2DCondition(..., attention_impl=)``); the computation is
diffusers' SDPA processor's, which is also why ``upcast_attention`` changes nothing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from cfx._src.core import random
from cfx._src.diffusion.composite import Composite, map_units
from cfx._src.diffusion.layers import Downsample2D, ResnetBlock2D, Upsample2D
from cfx._src.diffusion.transformer2d import Transformer2D
from cfx._src.diffusion.unet_config import UNet2DConditionConfig
from cfx._src.models.common import check_params
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.linear import Linear
from cfx._src.nn.norm import GroupNorm
from cfx._src.nn.sublayers import keep_sublayers
from cfx._src.precision.quant import floating_dtype
from cfx._src.transforms.shapes import eval_shape


# -- time ---------------------------------------------------------------------------------------------
def timestep_embedding(timesteps: torch.Tensor, dim: int, *, flip_sin_to_cos: bool = True,
                       freq_shift: float = 0.0, max_period: int = 10000) -> torch.Tensor:
    """diffusers' ``get_timestep_embedding``: ``(N,)`` timesteps -> ``(N, dim)`` fp32 sinusoids,
    frequencies ``exp(-log(max_period) * i / (dim/2 - freq_shift))``; ``[cos, sin]`` when flipped."""
    if timesteps.dim() != 1:
        raise ValueError(f"timestep_embedding: timesteps must be 1-D (N,), got shape {tuple(timesteps.shape)}.")
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - freq_shift))  # (half,)
    args = timesteps[:, None].float() * freqs[None, :]  # (N, half)
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1, 0, 0))
    return emb  # (N, dim)


@dataclasses.dataclass(frozen=True)
class TimestepEmbedding(Composite):
    """``linear_2(SiLU(linear_1(x)))``: ``(B, in_features) -> (B, dim)``."""

    in_features: int
    dim: int

    def __post_init__(self):
        keep_sublayers(self, {"linear_1": Linear(self.in_features, self.dim, axes_names=("time_in", "temb")),
                              "linear_2": Linear(self.dim, self.dim, axes_names=("temb_in", "temb"))})

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        L = self._sublayers
        return L["linear_2"].apply(p["linear_2"], F.silu(L["linear_1"].apply(p["linear_1"], x)))


# -- the blocks ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Attn:
    """The transformer a cross-attention block puts after each resnet (None in a plain block)."""

    heads: int
    context_dim: int
    layers: int = 1
    use_linear_projection: bool = False
    impl: str = "auto"

    def make(self, channels: int, groups: int) -> Transformer2D:
        return Transformer2D(channels, self.heads, self.context_dim, self.layers, groups,
                             self.use_linear_projection, self.impl)


@dataclasses.dataclass(frozen=True)
class DownBlock(Composite):
    """``CrossAttnDownBlock2D`` (``attn`` set) or ``DownBlock2D``: ``layers`` x (resnet, transformer?),
    then (unless the last block) a stride-2 conv. ``apply -> (h, skips)``: every layer's output and
    the downsampled one."""

    in_channels: int
    out_channels: int
    temb_channels: int
    layers: int
    groups: int
    eps: float
    add_downsample: bool
    padding: int = 1
    attn: _Attn | None = None

    def __post_init__(self):
        c = self.out_channels
        L = {"resnets": [ResnetBlock2D(self.in_channels if i == 0 else c, c, self.groups, self.eps, self.temb_channels)
                         for i in range(self.layers)]}
        if self.attn is not None:
            L["attentions"] = [self.attn.make(c, self.groups) for _ in range(self.layers)]
        if self.add_downsample:
            L["downsamplers"] = [Downsample2D(c, self.padding)]
        keep_sublayers(self, L)

    def apply(self, p: dict, h: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> tuple:
        L, skips = self._sublayers, []
        for i, (resnet, pr) in enumerate(zip(L["resnets"], p["resnets"])):
            h = resnet.apply(pr, h, temb)
            if self.attn is not None:
                h = L["attentions"][i].apply(p["attentions"][i], h, context)
            skips.append(h)
        if self.add_downsample:
            h = L["downsamplers"][0].apply(p["downsamplers"][0], h)  # (B, C, H/2, W/2)
            skips.append(h)
        return h, skips


@dataclasses.dataclass(frozen=True)
class MidBlock(Composite):
    """``UNetMidBlock2DCrossAttn``: resnet, then ``layers`` x (transformer, resnet)."""

    channels: int
    temb_channels: int
    groups: int
    eps: float
    attn: _Attn
    layers: int = 1

    def __post_init__(self):
        c = self.channels
        keep_sublayers(self, {
            "attentions": [self.attn.make(c, self.groups) for _ in range(self.layers)],
            "resnets": [ResnetBlock2D(c, c, self.groups, self.eps, self.temb_channels)
                        for _ in range(self.layers + 1)]})

    def apply(self, p: dict, h: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        L = self._sublayers
        h = L["resnets"][0].apply(p["resnets"][0], h, temb)
        for attn, pa, resnet, pr in zip(L["attentions"], p["attentions"], L["resnets"][1:], p["resnets"][1:]):
            h = resnet.apply(pr, attn.apply(pa, h, context), temb)
        return h


@dataclasses.dataclass(frozen=True)
class UpBlock(Composite):
    """``CrossAttnUpBlock2D`` (``attn`` set) or ``UpBlock2D``: ``layers`` x (concatenate the last skip
    on channels, resnet, transformer?), then (unless the last block) a 2x upsample. Resnet ``i`` takes
    ``prev_channels`` (i = 0) or ``out_channels``, plus the skip's: ``in_channels`` for the last one,
    ``out_channels`` otherwise (diffusers' ``res_skip_channels``)."""

    in_channels: int
    prev_channels: int
    out_channels: int
    temb_channels: int
    layers: int
    groups: int
    eps: float
    add_upsample: bool
    attn: _Attn | None = None

    def __post_init__(self):
        c, n = self.out_channels, self.layers
        L = {"resnets": [ResnetBlock2D((self.prev_channels if i == 0 else c) + (self.in_channels if i == n - 1 else c),
                                       c, self.groups, self.eps, self.temb_channels) for i in range(n)]}
        if self.attn is not None:
            L["attentions"] = [self.attn.make(c, self.groups) for _ in range(n)]
        if self.add_upsample:
            L["upsamplers"] = [Upsample2D(c)]
        keep_sublayers(self, L)

    def apply(self, p: dict, h: torch.Tensor, skips: list, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        L = self._sublayers
        for i, (resnet, pr) in enumerate(zip(L["resnets"], p["resnets"])):
            h = resnet.apply(pr, torch.cat([h, skips[-1 - i]], dim=1), temb)  # skips are used last first
            if self.attn is not None:
                h = L["attentions"][i].apply(p["attentions"][i], h, context)
        if self.add_upsample:
            h = L["upsamplers"][0].apply(p["upsamplers"][0], h)  # (B, C, 2H, 2W)
        return h


# -- the model ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UNet2DCondition(Composite):
    """diffusers' ``UNet2DConditionModel`` (see the module doc): ``apply(params, sample, timestep,
    encoder_hidden_states)`` -> the noise prediction ``(B, out_channels, H, W)``. ``attention_impl`` is
    ``cfx.nn.attention``'s ``impl`` (``"auto"``: the Triton kernel on CUDA, SDPA elsewhere)."""

    config: UNet2DConditionConfig
    attention_impl: str = "auto"
    block_map: tuple = ()   # functions applied to every block, first to last (``map_blocks``)

    def __post_init__(self):
        c = self.config
        boc, temb, g, eps = c.block_out_channels, c.temb_dim, c.norm_num_groups, c.norm_eps
        n = len(boc)
        heads, cross = c.per_block("attention_head_dim"), c.per_block("cross_attention_dim")
        layers, tlayers = c.per_block("layers_per_block"), c.per_block("transformer_layers_per_block")

        def attn(i: int) -> _Attn:
            return _Attn(heads[i], cross[i], tlayers[i], c.use_linear_projection, self.attention_impl)
        down = []
        for i, kind in enumerate(c.down_block_types):
            down.append(DownBlock(boc[max(i - 1, 0)], boc[i], temb, layers[i], g, eps, add_downsample=i < n - 1,
                                  padding=c.downsample_padding, attn=attn(i) if kind.startswith("CrossAttn") else None))
        up = []
        for i, kind in enumerate(c.up_block_types):
            r = n - 1 - i  # the down block this up block mirrors
            up.append(UpBlock(boc[max(r - 1, 0)], boc[min(r + 1, n - 1)], boc[r], temb, layers[r] + 1, g, eps,
                              add_upsample=i < n - 1, attn=attn(r) if kind.startswith("CrossAttn") else None))
        k_in, k_out = c.conv_in_kernel, c.conv_out_kernel
        L = {"conv_in": Conv2d(c.in_channels, boc[0], k_in, padding=(k_in - 1) // 2),
             "time_embedding": TimestepEmbedding(boc[0], temb), "down_blocks": down}
        if c.mid_block_type is not None:
            L["mid_block"] = MidBlock(boc[-1], temb, g, eps, attn(n - 1))
        L.update({"up_blocks": up, "conv_norm_out": GroupNorm(g, boc[0], eps),
                  "conv_out": Conv2d(boc[0], c.out_channels, k_out, padding=(k_out - 1) // 2)})
        blocks = []

        def block(layer: Any) -> Any:
            for f in self.block_map:
                layer = f(layer)
            blocks.append(layer)
            return layer
        keep_sublayers(self, map_units(L, (ResnetBlock2D, Transformer2D), block))
        object.__setattr__(self, "_blocks", tuple(blocks))

    @property
    def blocks(self) -> tuple:
        """The resnets and transformers, in the order they are built (down, mid, up): the layers
        a strategy wraps one by one (``map_blocks``: ZeRO-3's gathers, remat)."""
        return self._blocks

    def map_blocks(self, f: Any) -> "UNet2DCondition":
        """The same UNet with every block replaced by ``f(block)`` (same params tree)."""
        return dataclasses.replace(self, block_map=self.block_map + (f,))

    def check_inputs(self, sample: Any, encoder_hidden_states: Any) -> None:
        """ValueError on a sample or text states this UNet cannot take, naming the fix."""
        c = self.config
        if not (isinstance(sample, torch.Tensor) and sample.dim() == 4 and sample.shape[1] == c.in_channels):
            got = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
            raise ValueError(f"UNet2DCondition.apply: sample must be (B, in_channels={c.in_channels}, H, W), got "
                             f"{got}; pass 4-D latents with {c.in_channels} channels, or a UNet whose config has the "
                             "sample's in_channels.")
        f = 2 ** (len(c.block_out_channels) - 1)
        H, W = sample.shape[2:]
        if H % f or W % f:
            raise ValueError(f"UNet2DCondition.apply: the sample's height and width ({H}, {W}) must be multiples of "
                             f"{f}: the UNet halves them {len(c.block_out_channels) - 1} times and the skips must "
                             f"line up. Pad or resize the latents to a multiple of {f}.")
        e, width = encoder_hidden_states, c.per_block("cross_attention_dim")[0]
        if not (isinstance(e, torch.Tensor) and e.dim() == 3 and e.shape[0] == sample.shape[0] and e.shape[2] == width):
            got = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise ValueError(f"UNet2DCondition.apply: encoder_hidden_states must be (B={sample.shape[0]}, S, "
                             f"cross_attention_dim={width}), got {got}; pass the text encoder's last hidden states "
                             "for the same batch (a UNet's cross_attention_dim is its text encoder's width).")

    def timesteps(self, timestep: Any, batch: int, device: torch.device) -> torch.Tensor:
        """``timestep`` (a number, a 0-d, (1,) or (B,) tensor) as ``(B,)``, as diffusers broadcasts it."""
        if not isinstance(timestep, torch.Tensor):
            if isinstance(timestep, bool) or not isinstance(timestep, (int, float)):
                raise ValueError(f"UNet2DCondition.apply: timestep must be a number or a tensor, got "
                                 f"{type(timestep).__name__}.")
            timestep = torch.tensor([timestep], dtype=torch.float64 if isinstance(timestep, float) else torch.int64)
        if timestep.dim() == 0:
            timestep = timestep[None]
        if timestep.dim() != 1 or timestep.shape[0] not in (1, batch):
            raise ValueError(f"UNet2DCondition.apply: timestep must be a number, a 0-d tensor or a (B,) = ({batch},) "
                             f"tensor, got shape {tuple(timestep.shape)}.")
        return timestep.to(device).expand(batch)

    def apply(self, params: dict, sample: torch.Tensor, timestep: Any,
              encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """The noise (or v) prediction for ``sample`` ``(B, in_channels, H, W)`` at ``timestep``,
        conditioned on ``encoder_hidden_states`` ``(B, S, cross_attention_dim)``."""
        c, L = self.config, self._sublayers
        check_params("UNet2DCondition.apply", self, params)
        self.check_inputs(sample, encoder_hidden_states)
        dtype = floating_dtype(params["conv_in"])  # inputs follow the weights (bf16 params: bf16 compute)
        sample, encoder_hidden_states = sample.to(dtype), encoder_hidden_states.to(dtype)
        t = self.timesteps(timestep, sample.shape[0], sample.device)  # (B,)
        if c.center_input_sample:
            sample = 2 * sample - 1.0
        t_emb = timestep_embedding(t, c.block_out_channels[0], flip_sin_to_cos=c.flip_sin_to_cos,
                                   freq_shift=c.freq_shift).to(sample.dtype)  # (B, C0)
        emb = L["time_embedding"].apply(params["time_embedding"], t_emb)  # (B, temb)
        ctx = encoder_hidden_states
        h = L["conv_in"].apply(params["conv_in"], sample)  # (B, C0, H, W)
        skips = [h]
        for block, p in zip(L["down_blocks"], params["down_blocks"]):
            h, res = block.apply(p, h, emb, ctx)
            skips += res
        if "mid_block" in L:
            h = L["mid_block"].apply(params["mid_block"], h, emb, ctx)
        for block, p in zip(L["up_blocks"], params["up_blocks"]):
            n = block.layers
            h = block.apply(p, h, skips[-n:], emb, ctx)
            skips = skips[:-n]
        h = F.silu(L["conv_norm_out"].apply(params["conv_norm_out"], h))
        return L["conv_out"].apply(params["conv_out"], h)  # (B, out_channels, H, W)


# -- diffusers weights --------------------------------------------------------------------------------
_RENAME = {"to_out": "to_out.0", "w": "weight", "b": "bias", "scale": "weight"}
_RENAME_FF = {"proj": "net.0.proj", "out": "net.2"}


def _with_keys(tree: Any, fn: Any, path: tuple = ()) -> Any:
    """``tree`` (params, or their shapes) with each leaf replaced by ``fn(diffusers_key, transpose, leaf)``;
    ``transpose`` marks a Linear weight (cfx ``(in, out)``, torch ``(out, in)``)."""
    if isinstance(tree, dict):
        return {k: _with_keys(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_with_keys(v, fn, path + (i,)) for i, v in enumerate(tree)]
    return fn(diffusers_name(path), path[-1] == "w" and len(tree.shape) == 2, tree)


def diffusers_name(path: tuple) -> str:
    """diffusers' dotted name of the cfx params path ``path``, a leaf's or a module's
    (``("up_blocks", 1, ..., "attn1", "to_out")`` -> ``"up_blocks.1. ... .attn1.to_out.0"``)."""
    return ".".join((_RENAME_FF if i and path[i - 1] == "ff" else _RENAME).get(s, str(s)) for i, s in enumerate(path))


def from_diffusers(module_or_state_dict: Any, config: Any = None) -> tuple[UNet2DCondition, dict]:
    """``(model, params)`` from a ``diffusers.UNet2DConditionModel`` (its config and weights), or from
    its state dict with ``config`` (a ``UNet2DConditionConfig``, or a diffusers config / dict). The
    params are copies, in the weights' dtype."""
    if isinstance(module_or_state_dict, Mapping):
        if config is None:
            raise ValueError("from_diffusers: a state dict carries no config; pass config= (the UNet's "
                             "UNet2DConditionConfig, or the diffusers model's config).")
        sd = module_or_state_dict
    elif hasattr(module_or_state_dict, "state_dict"):
        sd = module_or_state_dict.state_dict()
        config = module_or_state_dict.config if config is None else config
    else:
        raise ValueError(f"from_diffusers: expected a diffusers UNet2DConditionModel or its state dict, got "
                         f"{type(module_or_state_dict).__name__}.")
    if not isinstance(config, UNet2DConditionConfig):
        config = UNet2DConditionConfig.from_diffusers(config)
    model = UNet2DCondition(config)
    reader = StateDictReader(sd, where="UNet2DCondition.from_diffusers", prefix="")
    params = _with_keys(eval_shape(model.init, random.key(0)),
                        lambda key, t, leaf: reader.take(key, leaf.shape[::-1] if t else leaf.shape, transpose=t))
    reader.finish(ignore=lambda k: False)
    return model, params


def to_diffusers_state_dict(model: UNet2DCondition, params: dict) -> dict[str, torch.Tensor]:
    """The ``UNet2DConditionModel`` state dict of ``params`` (copies; Linear weights transposed back),
    for ``load_state_dict`` into a diffusers UNet built from the same config."""
    check_params("to_diffusers_state_dict", model, params)
    out: dict[str, torch.Tensor] = {}
    _with_keys(params, lambda key, t, leaf: out.setdefault(key, copy(leaf.T if t else leaf)))
    return out
