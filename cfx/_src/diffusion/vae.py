"""Stable Diffusion's VAE (``diffusers.AutoencoderKL``) as pure functions over params.

Encoder and decoder mirror diffusers' ``Encoder`` / ``Decoder`` with ``DownEncoderBlock2D`` /
``UpDecoderBlock2D`` blocks (the only kinds Stable Diffusion's VAEs use)::

    encode:  x (B, in, H, W) -> conv_in -> down blocks (resnets, then a stride-2 conv except in the
             last) -> mid (resnet, attention, resnet) -> GroupNorm, SiLU, conv_out -> quant_conv
             -> mean, logvar  (B, latent, H / 2**n, W / 2**n), logvar clamped to [-30, 20]
    decode:  z -> post_quant_conv -> conv_in -> mid -> up blocks (resnets, then nearest 2x + conv
             except in the last) -> GroupNorm, SiLU, conv_out -> (B, out, H, W)

with ``n = len(block_out_channels) - 1``. Latent scaling is the caller's, as in diffusers:
``sample_latents`` returns ``(z - shift_factor) * scaling_factor`` (what a UNet is trained on), and
``decode`` takes UNSCALED latents, so a pipeline decodes ``latents / scaling_factor (+ shift)``.

Params: ``{"encoder", "quant_conv", "post_quant_conv", "decoder"}``, nested exactly as diffusers'
state dict keys (``encoder.down_blocks.0.resnets.1.conv1.weight`` is
``params["encoder"]["down_blocks"][0]["resnets"][1]["conv1"]["w"]``); ``from_diffusers`` and
``to_diffusers_state_dict`` convert by that renaming (Linear weights transposed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from cfx._src.core import random
from cfx._src.diffusion.layers import Downsample2D, ResnetBlock2D, SpatialAttention, Upsample2D
from cfx._src.models.common import check_params, config_from_preset
from cfx._src.models.hf_state import StateDictReader, copy
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.linear import split_keys
from cfx._src.nn.norm import GroupNorm
from cfx._src.transforms.shapes import eval_shape

AUTOENCODER_KL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
    "sd": dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=512,
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
}


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
    """diffusers' ``AutoencoderKL`` config fields (defaults: diffusers'). ``sample_size``,
    ``force_upcast``, ``latents_mean`` and ``latents_std`` are carried for round trips, unused here."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels", "latents_mean", "latents_std"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        n = len(self.block_out_channels)
        if n == 0 or any(not isinstance(c, int) or c <= 0 for c in self.block_out_channels):
            raise ValueError(f"AutoencoderKLConfig: block_out_channels must be positive ints, got "
                             f"{self.block_out_channels!r}.")
        for name, kind in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            v = getattr(self, name)
            if len(v) != n or any(t != kind for t in v):
                raise ValueError(f"AutoencoderKLConfig: {name} must be {n} x {kind!r} (one per block_out_channels "
                                 f"entry; no other block kind is supported), got {v!r}.")
        if self.act_fn != "silu":
            raise ValueError(f"AutoencoderKLConfig: only act_fn='silu' is supported, got {self.act_fn!r}.")
        for name in ("in_channels", "out_channels", "layers_per_block", "latent_channels", "norm_num_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"AutoencoderKLConfig: {name} must be a positive int, got {v!r}.")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"AutoencoderKLConfig: block_out_channels {bad} do not split into norm_num_groups="
                             f"{self.norm_num_groups} groups; use a group count dividing every width.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "AutoencoderKLConfig":
        """A named size (``tiny``; ``sd``: Stable Diffusion 1.x / 2.x's VAE) with field overrides."""
        return config_from_preset(cls, AUTOENCODER_KL_PRESETS, name, overrides)

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> "AutoencoderKLConfig":
        """From a diffusers ``AutoencoderKL.config`` (private ``_``-keys dropped)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in dict(config).items() if not k.startswith("_")}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"AutoencoderKLConfig.from_diffusers: unsupported config field(s) {unknown}; "
                             f"cfx knows {sorted(fields)}.")
        return cls(**kwargs)

    def to_diffusers(self) -> dict[str, Any]:
        """Keyword arguments for ``diffusers.AutoencoderKL(**...)``."""
        return dataclasses.asdict(self)


# -- layer trees: nested dicts / lists of layers, shaped like the params ------------------------------
def _layer_leaves(tree: Any) -> list:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _layer_leaves(v)]
    if isinstance(tree, list):
        return [leaf for v in tree for leaf in _layer_leaves(v)]
    return [tree]


def _map_layers(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map_layers(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_layers(fn, v) for v in tree]
    return fn(tree)


@dataclasses.dataclass(frozen=True)
class AutoencoderKL:
    """The KL autoencoder: ``init(key)``, ``axes()``, ``encode``, ``sample_latents``, ``decode``, ``apply``."""

    config: AutoencoderKLConfig = AutoencoderKLConfig()

    @property
    def n_down(self) -> int:
        """How many times the encoder halves H and W."""
        return len(self.config.block_out_channels) - 1

    def _mid(self) -> dict:
        c = self.config
        ch, res = c.block_out_channels[-1], ResnetBlock2D(c.block_out_channels[-1], c.block_out_channels[-1],
                                                          groups=c.norm_num_groups)
        mid = {"resnets": [res, res]}
        if c.mid_block_add_attention:
            mid["attentions"] = [SpatialAttention(ch, groups=c.norm_num_groups)]
        return mid

    def _layers(self) -> dict:
        c = self.config
        ch, G, L, Z = c.block_out_channels, c.norm_num_groups, c.layers_per_block, c.latent_channels
        down, cin = [], ch[0]
        for i, cout in enumerate(ch):
            block = {"resnets": [ResnetBlock2D(cin if j == 0 else cout, cout, groups=G) for j in range(L)]}
            if i < len(ch) - 1:
                block["downsamplers"] = [Downsample2D(cout, padding=0)]
            down.append(block)
            cin = cout
        up, cin = [], ch[-1]
        for i, cout in enumerate(reversed(ch)):
            block = {"resnets": [ResnetBlock2D(cin if j == 0 else cout, cout, groups=G) for j in range(L + 1)]}
            if i < len(ch) - 1:
                block["upsamplers"] = [Upsample2D(cout)]
            up.append(block)
            cin = cout
        layers = {
            "encoder": {"conv_in": Conv2d(c.in_channels, ch[0], 3, padding=1), "down_blocks": down,
                        "mid_block": self._mid(), "conv_norm_out": GroupNorm(G, ch[-1], 1e-6),
                        "conv_out": Conv2d(ch[-1], 2 * Z, 3, padding=1)},
            "decoder": {"conv_in": Conv2d(Z, ch[-1], 3, padding=1), "mid_block": self._mid(), "up_blocks": up,
                        "conv_norm_out": GroupNorm(G, ch[0], 1e-6),
                        "conv_out": Conv2d(ch[0], c.out_channels, 3, padding=1)},
        }
        if c.use_quant_conv:
            layers["quant_conv"] = Conv2d(2 * Z, 2 * Z, 1)
        if c.use_post_quant_conv:
            layers["post_quant_conv"] = Conv2d(Z, Z, 1)
        return layers

    def init(self, key: torch.Tensor) -> dict:
        layers = self._layers()
        keys = iter(split_keys(key, len(_layer_leaves(layers))))
        return _map_layers(lambda layer: layer.init(next(keys)), layers)

    def axes(self) -> dict:
        return _map_layers(lambda layer: layer.axes(), self._layers())

    # -- forward -------------------------------------------------------------------------------------
    @staticmethod
    def _run_mid(layers: dict, p: dict, h: torch.Tensor) -> torch.Tensor:
        h = layers["resnets"][0].apply(p["resnets"][0], h)
        if "attentions" in layers:
            h = layers["attentions"][0].apply(p["attentions"][0], h)
        return layers["resnets"][1].apply(p["resnets"][1], h)

    @staticmethod
    def _run_block(block: dict, p: dict, h: torch.Tensor) -> torch.Tensor:
        for layer, lp in zip(block["resnets"], p["resnets"]):
            h = layer.apply(lp, h)
        for name in ("downsamplers", "upsamplers"):
            for layer, lp in zip(block.get(name, ()), p.get(name, ())):
                h = layer.apply(lp, h)
        return h

    def encode(self, params: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, in_channels, H, W)`` (H, W multiples of ``2**n_down``) -> the posterior's
        ``mean`` and clamped ``logvar``, each ``(B, latent_channels, H / 2**n_down, W / 2**n_down)``."""
        check_params("AutoencoderKL.encode", self, params)
        c, f = self.config, 2 ** self.n_down
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != c.in_channels:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"AutoencoderKL.encode: x must be (B, in_channels={c.in_channels}, H, W), got {got}; "
                             "pass NCHW images with the config's channel count.")
        if x.shape[2] % f or x.shape[3] % f:
            raise ValueError(f"AutoencoderKL.encode: H and W must be multiples of 2**n_down = {f}, got x of shape "
                             f"{tuple(x.shape)}; pad or resize the images to a multiple of {f}.")
        layers = self._layers()
        E, pe = layers["encoder"], params["encoder"]
        h = E["conv_in"].apply(pe["conv_in"], x)  # (B, ch[0], H, W)
        for block, pb in zip(E["down_blocks"], pe["down_blocks"]):
            h = self._run_block(block, pb, h)
        h = self._run_mid(E["mid_block"], pe["mid_block"], h)  # (B, ch[-1], H/f, W/f)
        h = E["conv_out"].apply(pe["conv_out"], F.silu(E["conv_norm_out"].apply(pe["conv_norm_out"], h)))
        if "quant_conv" in layers:
            h = layers["quant_conv"].apply(params["quant_conv"], h)  # (B, 2 latent, H/f, W/f)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def sample_latents(self, params: dict, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``(mean + exp(logvar / 2) * noise - shift_factor) * scaling_factor`` with ``noise`` drawn from
        ``key``: the scaled latents a diffusion model trains on."""
        return self.latents_from_moments(*self.encode(params, x), key)

    def latents_from_moments(self, mean: torch.Tensor, logvar: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``sample_latents`` from ``encode``'s ``(mean, logvar)``: a trainer encodes its images once and
        draws new latents from the posterior every epoch."""
        noise = random.normal(key, tuple(mean.shape), dtype=mean.dtype).to(mean.device)
        z = mean + torch.exp(0.5 * logvar) * noise
        if self.config.shift_factor is not None:
            z = z - self.config.shift_factor
        return z * self.config.scaling_factor

    def decode(self, params: dict, latents: torch.Tensor) -> torch.Tensor:
        """UNSCALED ``latents`` ``(B, latent_channels, h, w)`` -> images ``(B, out_channels, h * 2**n_down,
        w * 2**n_down)``. As in diffusers, undoing ``scaling_factor`` (and ``shift_factor``) is the
        caller's: ``decode(params, latents / scaling_factor)``."""
        check_params("AutoencoderKL.decode", self, params)
        c = self.config
        if not isinstance(latents, torch.Tensor) or latents.dim() != 4 or latents.shape[1] != c.latent_channels:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"AutoencoderKL.decode: latents must be (B, latent_channels={c.latent_channels}, h, w), "
                             f"got {got}; pass the encoder's latents (NCHW).")
        layers = self._layers()
        D, pd = layers["decoder"], params["decoder"]
        z = latents
        if "post_quant_conv" in layers:
            z = layers["post_quant_conv"].apply(params["post_quant_conv"], z)
        h = D["conv_in"].apply(pd["conv_in"], z)  # (B, ch[-1], h, w)
        h = self._run_mid(D["mid_block"], pd["mid_block"], h)
        for block, pb in zip(D["up_blocks"], pd["up_blocks"]):
            h = self._run_block(block, pb, h)  # (B, ch[0], h f, w f) after the last
        return D["conv_out"].apply(pd["conv_out"], F.silu(D["conv_norm_out"].apply(pd["conv_norm_out"], h)))

    def apply(self, params: dict, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """diffusers' ``AutoencoderKL.forward``: decode the posterior's mean (``key=None``) or a sample
        drawn with ``key`` (no latent scaling on the way)."""
        mean, logvar = self.encode(params, x)
        z = mean
        if key is not None:
            z = mean + torch.exp(0.5 * logvar) * random.normal(key, tuple(mean.shape), dtype=mean.dtype).to(mean.device)
        return self.decode(params, z)


# -- diffusers conversion --------------------------------------------------------------------------
_LEAF_NAMES = {"w": "weight", "b": "bias", "scale": "weight", "bias": "bias"}


def _diffusers_keys(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """``(cfx path, diffusers key)`` for every leaf of a params-shaped tree (``to_out`` is diffusers'
    ``to_out.0``; ``w``/``scale`` -> ``weight``, ``b``/``bias`` -> ``bias``)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        names = [str(p) + (".0" if p == "to_out" else "") for p in prefix[:-1]]
        return [(prefix, ".".join([*names, _LEAF_NAMES[prefix[-1]]]))]
    return [pair for k, v in items for pair in _diffusers_keys(v, (*prefix, k))]


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def from_diffusers(state_dict_or_module: Any, config: AutoencoderKLConfig | Mapping | None = None
                   ) -> tuple[AutoencoderKL, dict]:
    """``(model, params)`` from a diffusers ``AutoencoderKL`` module, or from its ``state_dict()`` and
    ``config`` (an ``AutoencoderKLConfig`` or diffusers' config dict). Tensors are copied, dtypes kept."""
    if hasattr(state_dict_or_module, "state_dict") and hasattr(state_dict_or_module, "config"):
        config = state_dict_or_module.config if config is None else config
        state_dict = state_dict_or_module.state_dict()
    elif isinstance(state_dict_or_module, Mapping):
        state_dict = state_dict_or_module
    else:
        raise ValueError(f"from_diffusers: expected a diffusers AutoencoderKL or its state dict, got "
                         f"{type(state_dict_or_module).__name__}.")
    if config is None:
        raise ValueError("from_diffusers: a bare state dict needs config= (the diffusers model's config dict "
                         "or an AutoencoderKLConfig).")
    if not isinstance(config, AutoencoderKLConfig):
        config = AutoencoderKLConfig.from_diffusers(config)
    model = AutoencoderKL(config)
    shapes = eval_shape(model.init, random.key(0))
    reader = StateDictReader(state_dict, where="cfx.diffusion.vae.from_diffusers", prefix="")
    params = _map_layers(lambda s: None, shapes)
    for path, name in _diffusers_keys(shapes):
        shape = _get(shapes, path).shape
        linear = len(shape) == 2  # Linear weights are (in, out) here, (out, in) in torch
        _set(params, path, reader.take(name, shape[::-1] if linear else shape, transpose=linear))
    reader.finish(ignore=lambda k: False)
    return model, params


def to_diffusers_state_dict(model: AutoencoderKL, params: dict) -> dict[str, torch.Tensor]:
    """The diffusers ``AutoencoderKL`` state dict of ``params`` (``load_state_dict`` takes it strictly)."""
    check_params("to_diffusers_state_dict", model, params)
    out = {}
    for path, name in _diffusers_keys(params):
        t = _get(params, path)
        out[name] = copy(t.T if t.dim() == 2 else t)
    return out
