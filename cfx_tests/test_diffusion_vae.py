"""The VAE and its 2-D layers equal ``diffusers``: each layer (ResnetBlock2D with and without a time
embedding and a channel change, Down/Upsample2D, the mid-block attention) on random weights, in fp64
(``in_float64``); a tiny
random ``AutoencoderKL`` converted by ``from_diffusers`` encodes and decodes to diffusers' numbers,
its gradients equal autograd's through diffusers, and ``to_diffusers_state_dict`` loads back; the
``sd`` preset has SD's VAE layout; bad inputs and configs raise ValueErrors naming the shape and the fix."""
from __future__ import annotations

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.models.downsampling import Downsample2D as DDownsample2D  # noqa: E402
from diffusers.models.resnet import ResnetBlock2D as DResnetBlock2D  # noqa: E402
from diffusers.models.upsampling import Upsample2D as DUpsample2D  # noqa: E402

from cfx._src.core import random  # noqa: E402
from cfx._src.core import tree as tree_util  # noqa: E402
from cfx._src.diffusion import layers as L  # noqa: E402
from cfx._src.diffusion import vae as vae_lib  # noqa: E402
from cfx._src.diffusion.vae import (AutoencoderKL, AutoencoderKLConfig, from_diffusers,  # noqa: E402
                                    to_diffusers_state_dict)
from cfx._src.transforms.shapes import eval_shape  # noqa: E402

TINY = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32)


def randomize(module: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Every parameter (norm scales and biases included) redrawn, so no default init hides a mix-up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = 1.0 if name.endswith("weight") and p.dim() == 1 else 0.0  # norm scales around 1
            p.copy_(centre + torch.randn(p.shape, generator=g) * std)
    return module.eval()


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def conv(m):
    return {"w": m.weight, "b": m.bias}


def norm(m):
    return {"scale": m.weight, "bias": m.bias}


def linear(m):
    return {"w": m.weight.T, "b": m.bias}


def check_axes(layer, params):
    """``axes`` is ``init``'s structure with one name per tensor dim."""
    ax = layer.axes()
    tree_util.check_same_structure("axes vs params", tree_util.map(lambda a: 0, ax, is_leaf=tree_util.is_axes_leaf),
                                   tree_util.map(lambda t: 0, params))
    for a, t in zip(tree_util.leaves(ax, is_leaf=tree_util.is_axes_leaf), tree_util.leaves(params)):
        assert len(a) == t.dim()


# -- layers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cin,cout,temb", [(16, 16, None), (16, 32, None), (16, 32, 12), (32, 32, 12)])
def test_resnet_block_equals_diffusers(cin, cout, temb):
    ref = randomize(DResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=temb, groups=4, eps=1e-6),
                    0).double()
    layer = L.ResnetBlock2D(cin, cout, groups=4, temb_channels=temb)
    p = {"norm1": norm(ref.norm1), "conv1": conv(ref.conv1), "norm2": norm(ref.norm2), "conv2": conv(ref.conv2)}
    if temb:
        p["time_emb_proj"] = linear(ref.time_emb_proj)
    if cin != cout:
        p["conv_shortcut"] = conv(ref.conv_shortcut)
    check_axes(layer, layer.init(random.key(0)))
    tree_util.check_same_structure("init vs converted", tree_util.map(lambda t: 0, layer.init(random.key(0))),
                                   tree_util.map(lambda t: 0, p))
    x, t = randn(1, 2, cin, 8, 6).double(), (randn(2, 2, temb).double() if temb else None)
    torch.testing.assert_close(layer.apply(p, x, t), ref(x, t))


def test_resnet_block_refuses_a_missing_or_stray_temb():
    with_temb, without = L.ResnetBlock2D(8, 8, groups=4, temb_channels=5), L.ResnetBlock2D(8, 8, groups=4)
    x = randn(0, 1, 8, 4, 4)
    with pytest.raises(ValueError, match=r"temb must be \(B, temb_channels\) = \(1, 5\), got None"):
        with_temb.apply(with_temb.init(random.key(0)), x)
    with pytest.raises(ValueError, match="temb_channels=temb.shape"):
        without.apply(without.init(random.key(0)), x, randn(1, 1, 5))


@pytest.mark.parametrize("padding,hw", [(1, (8, 8)), (1, (9, 7)), (0, (8, 8)), (0, (9, 7))])
def test_downsample_equals_diffusers(padding, hw):
    ref = randomize(DDownsample2D(16, use_conv=True, padding=padding), 1).double()
    layer = L.Downsample2D(16, padding=padding)
    check_axes(layer, layer.init(random.key(0)))
    x = randn(3, 2, 16, *hw).double()
    out = layer.apply({"conv": conv(ref.conv)}, x)
    torch.testing.assert_close(out, ref(x))
    half = ((hw[0] + 1) // 2, (hw[1] + 1) // 2) if padding else (hw[0] // 2, hw[1] // 2)
    assert tuple(out.shape[2:]) == half


@pytest.mark.parametrize("output_size", [None, (9, 11)])
def test_upsample_equals_diffusers(output_size):
    ref = randomize(DUpsample2D(16, use_conv=True), 2).double()
    layer = L.Upsample2D(16)
    check_axes(layer, layer.init(random.key(0)))
    x = randn(4, 2, 16, 5, 6).double()
    torch.testing.assert_close(layer.apply({"conv": conv(ref.conv)}, x, output_size=output_size),
                               ref(x, output_size=output_size))


@pytest.mark.parametrize("heads", [1, 2])
def test_spatial_attention_equals_diffusers(heads):
    C = 32
    # as diffusers' UNetMidBlock2D builds it for the VAE
    ref = randomize(Attention(C, heads=heads, dim_head=C // heads, rescale_output_factor=1.0, eps=1e-6,
                              norm_num_groups=8, residual_connection=True, bias=True, upcast_softmax=True,
                              _from_deprecated_attn_block=True), 3).double()
    layer = L.SpatialAttention(C, groups=8, heads=heads)
    p = {"group_norm": norm(ref.group_norm), "to_q": linear(ref.to_q), "to_k": linear(ref.to_k),
         "to_v": linear(ref.to_v), "to_out": linear(ref.to_out[0])}
    check_axes(layer, layer.init(random.key(0)))
    x = randn(5, 2, C, 6, 5).double()
    torch.testing.assert_close(layer.apply(p, x), ref(x))
    with pytest.raises(ValueError, match=r"x must be \(B, 32, H, W\), got \(2, 16, 6, 5\)"):
        layer.apply(p, x[:, :16])


# -- the VAE ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    ref = randomize(diffusers.AutoencoderKL(**TINY), 7, std=0.1)
    model, params = from_diffusers(ref)
    return ref, model, params


def test_config_and_init_match_the_diffusers_model(tiny):
    ref, model, params = tiny
    assert model.config == AutoencoderKLConfig.preset("tiny", sample_size=32)
    fresh = model.init(random.key(0))
    check_axes(model, fresh)
    tree_util.check_same_structure("init vs converted", tree_util.map(lambda t: 0, fresh),
                                   tree_util.map(lambda t: 0, params))
    assert sum(t.numel() for t in tree_util.leaves(fresh)) == sum(p.numel() for p in ref.parameters())
    # a bare state dict with diffusers' config dict converts to the same params
    _, again = from_diffusers(ref.state_dict(), config=dict(ref.config))
    tree_util.assert_tree_close(again, params, rtol=0, atol=0)


def in_float64(ref):
    """diffusers' VAE and its cfx conversion in float64: where the claim is that both compute the same
    function, compare there -- in fp32 the two sides sum convolutions in other orders (the kernels
    differ by CPU), some 1e-5 apart on values of order 1."""
    ref64 = diffusers.AutoencoderKL(**TINY).double().eval()
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    model, params = from_diffusers(ref64)
    return ref64, model, params


def test_encode_and_decode_equal_diffusers(tiny):
    ref64, model, params = in_float64(tiny[0])
    x, z = randn(10, 2, 3, 32, 32).double(), randn(11, 2, 4, 16, 16).double()
    with torch.no_grad():
        post = ref64.encode(x).latent_dist
        mean, logvar = model.encode(params, x)
        torch.testing.assert_close(mean, post.mean)
        torch.testing.assert_close(logvar, post.logvar)
        torch.testing.assert_close(model.decode(params, z), ref64.decode(z).sample)
        torch.testing.assert_close(model.apply(params, x), ref64(x).sample)


def test_logvar_is_clamped_as_diffusers_does(tiny):
    ref, model, params = tiny
    params = tree_util.map(lambda t: t, params)
    b = params["quant_conv"]["b"].clone()
    b[4:] = torch.tensor([100.0, -100.0, 0.0, 0.0])  # the logvar half: pushed past both clamps
    params["quant_conv"] = {**params["quant_conv"], "b": b}
    with torch.no_grad():
        _, logvar = model.encode(params, randn(12, 1, 3, 16, 16))
    assert logvar[:, 0].eq(20.0).all() and logvar[:, 1].eq(-30.0).all()


def test_sample_latents_is_the_scaled_reparameterised_sample(tiny):
    _, model, params = tiny
    x, key = randn(13, 2, 3, 16, 16), random.key(3)
    with torch.no_grad():
        mean, logvar = model.encode(params, x)
        noise = random.normal(key, tuple(mean.shape))
        want = (mean + torch.exp(0.5 * logvar) * noise) * 0.18215
        torch.testing.assert_close(model.sample_latents(params, x, key), want)
        z = mean + torch.exp(0.5 * logvar) * noise
        torch.testing.assert_close(model.apply(params, x, key), model.decode(params, z))
        assert not torch.allclose(model.sample_latents(params, x, random.key(4)), want)
        shifted = AutoencoderKL(AutoencoderKLConfig(**{**model.config.__dict__, "shift_factor": 0.5}))
        torch.testing.assert_close(shifted.sample_latents(params, x, key), want - 0.5 * 0.18215)


def test_to_diffusers_state_dict_round_trips(tiny):
    ref, model, params = tiny
    fresh = diffusers.AutoencoderKL(**TINY).eval()
    fresh.load_state_dict(to_diffusers_state_dict(model, params), strict=True)
    x, z = randn(14, 1, 3, 32, 32), randn(15, 1, 4, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).sample, ref(x).sample, rtol=0, atol=0)
        fresh.double()  # then the two functions, in fp64 (in_float64)
        to64 = lambda tree: tree_util.map(lambda t: t.double(), tree)  # noqa: E731
        torch.testing.assert_close(fresh.decode(z.double()).sample, model.decode(to64(params), z.double()))
    # and a cfx-initialised VAE (fresh weights of its own) drives diffusers to the same numbers
    own = to64(model.init(random.key(1)))
    fresh.load_state_dict(to_diffusers_state_dict(model, own), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh.decode(z.double()).sample, model.decode(own, z.double()))


def test_gradients_equal_diffusers_autograd(tiny):
    # in float64 (in_float64; besides, to_k's bias, whose true gradient is 0, gets rounding noise on both sides)
    ref64, model, params = in_float64(tiny[0])
    params = tree_util.map(lambda t: t.requires_grad_(True), params)
    x, w = randn(16, 2, 3, 16, 16).double(), randn(17, 2, 3, 16, 16).double()

    ref64.zero_grad()
    (ref64(x).sample * w).sum().backward()
    (model.apply(params, x) * w).sum().backward()

    want = {k: p.grad for k, p in ref64.named_parameters()}
    got = to_diffusers_state_dict(model, tree_util.map(lambda t: t.grad, params))
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{k}: {m}")


def test_bad_inputs_raise(tiny):
    _, model, params = tiny
    with pytest.raises(ValueError, match=r"in_channels=3.*got \(1, 4, 16, 16\)"):
        model.encode(params, randn(0, 1, 4, 16, 16))
    with pytest.raises(ValueError, match=r"multiples of 2\*\*n_down = 2, got x of shape \(1, 3, 16, 15\).*pad"):
        model.encode(params, randn(0, 1, 3, 16, 15))
    with pytest.raises(ValueError, match=r"latent_channels=4, h, w\), got \(1, 3, 8, 8\)"):
        model.decode(params, randn(0, 1, 3, 8, 8))
    with pytest.raises(ValueError, match="DownEncoderBlock2D"):
        AutoencoderKLConfig(**{**TINY, "down_block_types": ("DownEncoderBlock2D", "AttnDownEncoderBlock2D")})
    with pytest.raises(ValueError, match="norm_num_groups=32"):
        AutoencoderKLConfig(**{**TINY, "norm_num_groups": 32, "block_out_channels": (48, 64)})
    with pytest.raises(ValueError, match="needs config="):
        from_diffusers({})
    sd = to_diffusers_state_dict(model, params)
    with pytest.raises(ValueError, match="no 'decoder.conv_out.bias'"):
        from_diffusers({k: v for k, v in sd.items() if k != "decoder.conv_out.bias"}, config=model.config)
    with pytest.raises(ValueError, match="unexpected keys.*'extra'"):
        from_diffusers({**sd, "extra": torch.zeros(1)}, config=model.config)
    with pytest.raises(ValueError, match="expects"):
        from_diffusers(sd, config=AutoencoderKLConfig(**{**TINY, "latent_channels": 8}))


def test_sd_preset_has_the_stable_diffusion_vae_layout():
    """The ``sd`` preset's params map one to one, shape for shape, onto SD 1.x's VAE state dict (the
    diffusers model is built on the meta device: no weights allocated)."""
    cfg = AutoencoderKLConfig.preset("sd")
    with torch.device("meta"):
        ref = diffusers.AutoencoderKL(**cfg.to_diffusers())
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    model = AutoencoderKL(cfg)
    shapes = eval_shape(model.init, random.key(0))
    got = {}
    for path, name in vae_lib._diffusers_keys(shapes):
        t = shapes
        for p in path:
            t = t[p]
        got[name] = tuple(t.shape[::-1]) if len(t.shape) == 2 else tuple(t.shape)
    assert got == want
    assert sum(math.prod(s) for s in got.values()) == 83_653_863  # SD's VAE: 83.7M parameters
