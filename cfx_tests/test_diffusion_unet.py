"""The UNet as a pure function equals ``diffusers.UNet2DConditionModel``: a tiny random UNet (built from
its config, never downloaded) converted with ``from_diffusers`` predicts the same noise in fp32, with
1x1-conv and Linear projections, for every timestep form (float64 on both sides: the claim is the
same function, which fp32 decides only up to the order each CPU's convolution kernels sum in);
``to_diffusers_state_dict`` loads back into diffusers; gradients w.r.t. the params equal diffusers'
(float64); bad inputs and unsupported options are refused naming the fix."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import cfx  # noqa: E402
from cfx._src.diffusion import unet as U  # noqa: E402
from cfx._src.core.tree import is_axes_leaf  # noqa: E402

TINY = dict(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)


def reference(seed: int = 0, **overrides) -> "diffusers.UNet2DConditionModel":
    """A tiny diffusers UNet in eval mode, every param perturbed (norm scales off 1, biases off 0), so a
    swapped or misplaced weight changes the output."""
    torch.manual_seed(seed)
    ref = diffusers.UNet2DConditionModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref


def inputs(seed: int = 1, batch: int = 2, size: int = 16, text_len: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, size, size, generator=g), torch.randn(batch, text_len, 32, generator=g)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def converted(ref):
    return U.from_diffusers(ref)


@pytest.mark.parametrize("linear", [False, True], ids=["conv-proj", "linear-proj"])
def test_noise_prediction_equals_diffusers(linear):
    ref = reference(seed=3, use_linear_projection=linear).double()  # fp64 (module doc)
    model, params = U.from_diffusers(ref)
    assert model.config.use_linear_projection is linear
    sample, text = (x.double() for x in inputs())
    with torch.no_grad():
        want = ref(sample, 420, text).sample
    torch.testing.assert_close(model.apply(params, sample, 420, text), want)


VARIANTS = {  # every implemented config field off its default, as SD 2.x and other UNets set them
    "sd2-like": dict(down_block_types=("CrossAttnDownBlock2D",) * 2, up_block_types=("CrossAttnUpBlock2D",) * 2,
                     attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), layers_per_block=(2, 1),
                     use_linear_projection=True, upcast_attention=True, time_embedding_dim=48,
                     center_input_sample=True, flip_sin_to_cos=False, freq_shift=1),
    "three-levels-no-mid": dict(mid_block_type=None, block_out_channels=(16, 32, 32),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                conv_in_kernel=1, conv_out_kernel=5),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_equal_diffusers(variant):
    ref = reference(seed=1, **VARIANTS[variant]).double()
    model, params = U.from_diffusers(ref)
    sample, text = (x.double() for x in inputs())
    with torch.no_grad():
        want = ref(sample, 321, text).sample
    torch.testing.assert_close(model.apply(params, sample, 321, text), want)


def test_timestep_forms():
    ref = reference().double()  # the ``ref`` fixture's weights, in fp64
    model, params = U.from_diffusers(ref)
    sample, text = (x.double() for x in inputs(seed=2))
    with torch.no_grad():
        want = ref(sample, 37, text).sample
        want_each = ref(sample, torch.tensor([3, 900]), text).sample
        want_float = ref(sample, 37.5, text).sample
    for t in (37, torch.tensor(37), torch.tensor([37]), torch.tensor([37, 37]), torch.tensor(37.0)):
        torch.testing.assert_close(model.apply(params, sample, t, text), want)
    torch.testing.assert_close(model.apply(params, sample, torch.tensor([3, 900]), text), want_each)
    torch.testing.assert_close(model.apply(params, sample, 37.5, text), want_float)
    assert not torch.allclose(want_each[0], want_each[1], atol=1e-3)  # per-sample timesteps differ


def test_timestep_embedding_equals_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0, 1, 17, 999, 500])
    for dim in (32, 33):
        want = get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        torch.testing.assert_close(U.timestep_embedding(t, dim), want, rtol=0, atol=0)
    want = get_timestep_embedding(t, 32, flip_sin_to_cos=False, downscale_freq_shift=1)
    torch.testing.assert_close(U.timestep_embedding(t, 32, flip_sin_to_cos=False, freq_shift=1), want, rtol=0, atol=0)


def test_state_dict_round_trip(ref, converted):
    model, params = converted
    sd = U.to_diffusers_state_dict(model, params)
    want = ref.state_dict()
    assert sorted(sd) == sorted(want)
    for k in want:
        torch.testing.assert_close(sd[k], want[k], rtol=0, atol=0, msg=k)
    fresh = diffusers.UNet2DConditionModel(**TINY).eval()
    fresh.load_state_dict(sd, strict=True)
    sample, text = inputs(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(fresh(sample, 5, text).sample, ref(sample, 5, text).sample, rtol=0, atol=0)
    # from a bare state dict and the config: the same params
    model2, params2 = U.from_diffusers(want, config=ref.config)
    assert model2 == model
    cfx.tree.assert_tree_close(params2, params, rtol=0, atol=0)


def test_init_axes_and_params_agree(converted):
    model, params = converted
    fresh = model.init(cfx.random.key(0))
    shapes = lambda tree: cfx.tree.map(lambda x: tuple(x.shape), tree)  # noqa: E731
    assert shapes(fresh) == shapes(params)
    axes = model.axes()
    dims = cfx.tree.map(lambda x: len(x.shape), fresh)
    assert cfx.tree.map(len, axes, is_leaf=is_axes_leaf) == dims
    sample, text = inputs()
    out = model.apply(fresh, sample, 10, text)
    assert out.shape == sample.shape and torch.isfinite(out).all()


def test_gradients_equal_diffusers():
    # float64: the gradient of a deep graph compared leaf by leaf; fp32 rounding would need loose tolerances
    ref = reference(seed=5).double()
    model, params = U.from_diffusers(ref)
    sample, text = (x.double() for x in inputs(seed=6))
    weight = torch.randn(sample.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (ref(sample, torch.tensor([10, 700]), text).sample * weight).sum().backward()
    want = {k: p.grad for k, p in ref.named_parameters()}

    grads = cfx.grad(lambda p: (model.apply(p, sample, torch.tensor([10, 700]), text) * weight).sum())(params)
    got = U.to_diffusers_state_dict(model, grads)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_bad_inputs_name_the_fix(converted):
    model, params = converted
    sample, text = inputs()
    with pytest.raises(ValueError, match=r"in_channels=4"):
        model.apply(params, torch.randn(2, 3, 16, 16), 1, text)
    with pytest.raises(ValueError, match=r"multiples of 2.*Pad or resize"):
        model.apply(params, torch.randn(2, 4, 15, 16), 1, text)
    with pytest.raises(ValueError, match=r"cross_attention_dim=32"):
        model.apply(params, sample, 1, torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"B=2"):
        model.apply(params, sample, 1, torch.randn(3, 7, 32))
    with pytest.raises(ValueError, match=r"timestep must be"):
        model.apply(params, sample, torch.tensor([1, 2, 3]), text)
    with pytest.raises(ValueError, match=r"from_diffusers: the state dict has no"):
        U.from_diffusers({}, config=U.UNet2DConditionConfig(**TINY))
    with pytest.raises(ValueError, match=r"pass config="):
        U.from_diffusers({})


def test_unsupported_options_are_named():
    with pytest.raises(ValueError, match=r"resnet_time_scale_shift"):
        U.from_diffusers(diffusers.UNet2DConditionModel(**TINY, resnet_time_scale_shift="scale_shift"))
    with pytest.raises(ValueError, match=r"class_embed_type.*addition_embed_type|addition_embed_type.*class"):
        U.UNet2DConditionConfig.from_diffusers({**TINY, "class_embed_type": "timestep", "addition_embed_type": "text"})
    with pytest.raises(ValueError, match=r"up_block_types \['AttnUpBlock2D'\]"):
        U.UNet2DConditionConfig(**{**TINY, "up_block_types": ("UpBlock2D", "AttnUpBlock2D")})
    with pytest.raises(ValueError, match=r"not divisible by attention_head_dim=5"):
        U.UNet2DConditionConfig(**{**TINY, "attention_head_dim": 5})
    with pytest.raises(ValueError, match=r"multiples of norm_num_groups=12"):
        U.UNet2DConditionConfig(**{**TINY, "norm_num_groups": 12})
    # diffusers' defaults (and its bookkeeping fields) are accepted
    cfg = U.UNet2DConditionConfig.from_diffusers(diffusers.UNet2DConditionModel(**TINY).config)
    assert cfg == U.UNet2DConditionConfig(**TINY)
