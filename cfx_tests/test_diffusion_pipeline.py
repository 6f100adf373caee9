"""A diffusers pipeline directory (tiny random components saved with ``save_pretrained``) loads into
cfx with the same outputs; ``save_pipeline`` writes a directory diffusers and transformers load
back with the same outputs; a missing part or pickled weights are clear errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import cfx  # noqa: E402
from cfx._src.diffusion.pipeline import load_pipeline, save_pipeline  # noqa: E402


def components(seed=0):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                          layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                          attention_head_dim=4, norm_num_groups=8).eval()
    vae = diffusers.AutoencoderKL(block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, latent_channels=4,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2).eval()
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=99, hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, eos_token_id=2, bos_token_id=0, pad_token_id=1)).eval()
    sched = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                    clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return unet, vae, text, sched


def outputs(unet, vae, text, latents, image, tokens):
    with torch.no_grad():
        hidden = text(tokens).last_hidden_state
        return (unet(latents, 10, hidden).sample, vae.encode(image).latent_dist.mean, vae.decode(latents).sample, hidden)


def cfx_outputs(p, latents, image, tokens):
    with torch.no_grad():
        hidden, _ = p.text_encoder.apply(p.text_params, tokens)
        return (p.unet.apply(p.unet_params, latents, 10, hidden), p.vae.encode(p.vae_params, image)[0],
                p.vae.decode(p.vae_params, latents), hidden)


def in_float64(p):
    """The loaded pipeline with its three models' params in fp64."""
    import dataclasses
    to64 = lambda tree: cfx.tree.map(lambda x: x.double(), tree)  # noqa: E731
    return dataclasses.replace(p, unet_params=to64(p.unet_params), vae_params=to64(p.vae_params),
                               text_params=to64(p.text_params))


@pytest.mark.timeout(120)
def test_a_diffusers_directory_loads_and_saves_back(tmp_path):
    unet, vae, text, sched = components()
    for name, part in (("unet", unet), ("vae", vae), ("text_encoder", text), ("scheduler", sched)):
        part.save_pretrained(tmp_path / "pipe" / name)
    g = torch.Generator().manual_seed(1)
    latents, image = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 3, 16, 16, generator=g)
    tokens = torch.randint(0, 99, (2, 7), generator=g)
    want = outputs(unet, vae, text, latents, image, tokens)
    p = load_pipeline(tmp_path / "pipe")
    assert p.schedule == cfx.diffusion.Schedule.from_diffusers(sched)
    # the same functions: compared in fp64 (fp32 leaves the last bits to each CPU's conv kernels)
    for a, b in zip(cfx_outputs(in_float64(p), latents.double(), image.double(), tokens),
                    outputs(unet.double(), vae.double(), text.double(), latents.double(), image.double(), tokens)):
        torch.testing.assert_close(a, b)
    save_pipeline(tmp_path / "out", p)  # and back: diffusers and transformers read what cfx wrote
    again = outputs(diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "out" / "unet").eval(),
                    diffusers.AutoencoderKL.from_pretrained(tmp_path / "out" / "vae").eval(),
                    transformers.CLIPTextModel.from_pretrained(tmp_path / "out" / "text_encoder").eval(),
                    latents, image, tokens)
    for a, b in zip(again, want):
        torch.testing.assert_close(a, b)
    assert diffusers.DDIMScheduler.from_pretrained(tmp_path / "out" / "scheduler").config.steps_offset == 1


def test_missing_parts_and_pickles_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unet/config.json' is missing; .* is not a Stable Diffusion pipeline"):
        load_pipeline(tmp_path)
    unet, *_ = components()
    unet.save_pretrained(tmp_path / "unet", safe_serialization=False)
    assert any(n.endswith(".bin") for n in os.listdir(tmp_path / "unet"))
    with pytest.raises(ValueError, match="pickled .bin weights; convert them"):
        load_pipeline(tmp_path)
    json.loads((tmp_path / "unet" / "config.json").read_text())  # the config was there all along


@pytest.mark.timeout(120)
def test_components_of_two_pipelines_are_refused(tmp_path):
    unet, vae, text, sched = components()
    wide = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=99, hidden_size=24, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=77, eos_token_id=2, bos_token_id=0, pad_token_id=1))
    for name, part in (("unet", unet), ("vae", vae), ("text_encoder", wide), ("scheduler", sched)):
        part.save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match="cross-attends to states of width 16, but .*text_encoder/config.json' has "
                                         "hidden_size 24"):
        load_pipeline(tmp_path)
    eight = diffusers.AutoencoderKL(block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
                                    latent_channels=8, down_block_types=("DownEncoderBlock2D",) * 2,
                                    up_block_types=("UpDecoderBlock2D",) * 2)
    text.save_pretrained(tmp_path / "text_encoder")
    eight.save_pretrained(tmp_path / "vae")
    with pytest.raises(ValueError, match="takes and predicts 4 / 4 channels, but .*vae/config.json' makes latents of 8"):
        load_pipeline(tmp_path)
