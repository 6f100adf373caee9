"""``python -m cfx.bench diffusion``: Stable Diffusion's training memory, int8 bytes and sampling speed.

* ``train_memory_reduction``: the device bytes one rank holds at its peak during a training step
  of a small UNet at batch 16 per rank (``cfx.memory.track(ops=True)``: params, gradients,
  optimizer state, gathered blocks, chunk copies and every op output and saved tensor), plain
  over the cfx recipe. Plain: fp32 params and compute, AdamW, attention materialising its score
  matrices (diffusers' ``AttnProcessor``), one rank. Recipe (Colossal-AI's): bf16 compute, flash
  attention (``cfx.nn.attention``: the Triton kernel on CUDA, SDPA's flash kernel on CPU), remat
  of every resnet and transformer, ZeRO-3 over 2 ranks with the pieces, gradients and AdamW state
  offloaded to the host (``Plan("data=2 zero=3 offload=host remat=blocks precision=bf16")``).
  Anchor 5.6x (64.5 GB -> 11.6 GB per GPU at batch 16).
* ``int8_unet_bytes_reduction``: the UNet's bytes in fp16 over its bytes with weight-only int8
  Linear and convolution weights (``cfx.quant``: int8 values, an fp32 scale per output channel;
  everything else fp16). Anchor 2.5x; int8 holds one byte per weight where fp16 holds two, so a
  weight-only scheme is bounded by 2x against fp16 (the fp32 -> int8 ratio is given beside it).
* ``samples_per_s_vs_diffusers``: images per second of ``cfx.diffusion.sample_images`` over
  diffusers' ``StableDiffusionPipeline`` on the same tiny components, text states, starting
  latents and threads (DDIM with classifier-free guidance, decoded), interleaved medians.
"""
from __future__ import annotations

import tempfile

import torch

import cfx
from cfx.bench.common import Row, interleaved_medians, report, size_of

RECIPE = "data=2 zero=3 offload=host remat=blocks precision=bf16"
PLAIN = "data=1"


def unet_config(size: str) -> cfx.diffusion.UNet2DConditionConfig:
    """SD 1.x's block layout (cross-attention down / mid / up blocks), narrower."""
    widths = {"smoke": (16, 16, 16), "quick": (32, 64, 64), "full": (64, 128, 128)}[size]
    return cfx.diffusion.UNet2DConditionConfig(
        in_channels=4, out_channels=4, block_out_channels=widths, layers_per_block=2 if size == "full" else 1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16 if size != "smoke" else 8)


def train_peak(plan_text: str, config, *, rows: int, latent: int, attention: str) -> dict:
    """One training step's device peak on the largest rank (after a warm-up step), in bytes."""
    unet = cfx.diffusion.UNet2DCondition(config, attention_impl=attention)
    model = cfx.diffusion.Denoiser(unet, cfx.diffusion.Schedule())
    plan = cfx.parallel.Plan.parse(plan_text)
    B = rows * plan.size("data")
    g = torch.Generator().manual_seed(0)
    latents, text = torch.randn(B, 4, latent, latent, generator=g), torch.randn(B, 77, 64, generator=g)
    batch = (latents, text, *cfx.diffusion.draw(model.schedule, cfx.random.key(0), latents))
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-4), mesh=mesh)
        state, _ = step(step.init(cfx.random.key(0)), batch)
        with cfx.memory.track(ops=True) as mem:
            state, _ = step(state, batch)
        ranks = list(mesh.local_ranks)
        return {"device": max(mem.peak("device", rank=r) for r in ranks),
                "host": max(mem.peak("host", rank=r) for r in ranks),
                "kinds": mem.peak_by_kind("device", rank=ranks[0])}


def int8_rows(config) -> list[Row]:
    unet = cfx.diffusion.UNet2DCondition(config)
    params = unet.init(cfx.random.key(0))
    half = cfx.tree.map(lambda x: x.half(), params)
    q = cfx.quant.quantize(half, "int8", axes=unet.axes(), min_size=0)
    fp16, int8, fp32 = cfx.tree.nbytes(half), cfx.tree.nbytes(q), cfx.tree.nbytes(params)
    return [Row("int8_unet_bytes_reduction (fp16 / int8 weights + fp16 rest)", fp16 / int8, "x", ">= 2.5",
                fp16 / int8 >= 2.5),
            Row("  fp32 / int8 UNet bytes", fp32 / int8, "x")]


def tiny_pipeline(directory: str):
    """A tiny random pipeline saved by diffusers / transformers: (cfx's Pipeline, diffusers')."""
    import diffusers
    import transformers
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16).eval()
    vae = diffusers.AutoencoderKL(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=16,
                                  latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2).eval()
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, eos_token_id=2, bos_token_id=0, pad_token_id=1)).eval()
    sched = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                    clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    for name, part in (("unet", unet), ("vae", vae), ("text_encoder", text), ("scheduler", sched)):
        part.save_pretrained(f"{directory}/{name}")
    ref = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=None, unet=unet, scheduler=sched,
                                            safety_checker=None, feature_extractor=None,
                                            requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    return cfx.diffusion.load_pipeline(directory), ref


def sampling_rows(size: str) -> list[Row]:
    from cfx._src.diffusion.sampling import sample, text_states
    steps, batch, rounds, warmup = {"smoke": (2, 1, 1, 0), "quick": (10, 2, 3, 1), "full": (25, 4, 7, 1)}[size]
    with tempfile.TemporaryDirectory() as d:
        p, ref = tiny_pipeline(d)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 99, (batch, 77), generator=g)
        with torch.no_grad():
            cond, uncond = text_states(p, tokens), text_states(p, torch.zeros_like(tokens))
        latents = torch.randn(batch, 4, 16, 16, generator=g)

        def ours():
            sample(p, cond, uncond, steps=steps, guidance_scale=7.5, latents=latents)

        def theirs():
            with torch.no_grad():
                ref(prompt_embeds=cond, negative_prompt_embeds=uncond, latents=latents, num_inference_steps=steps,
                    guidance_scale=7.5, output_type="pt", height=32, width=32)
        t_ours, t_theirs = interleaved_medians([ours, theirs], rounds=rounds, warmup=warmup)
    return [Row(f"samples_per_s_vs_diffusers ({batch} images, {steps} DDIM steps, 32x32)", t_theirs / t_ours, "x",
                ">= 1.0", t_theirs / t_ours >= 1.0),
            Row("  cfx images per second", batch / t_ours, "img/s"),
            Row("  diffusers images per second", batch / t_theirs, "img/s")]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    config = unet_config(size)
    batch, latent = {"smoke": (1, 4), "quick": (16, 16), "full": (16, 32)}[size]
    plain = train_peak(PLAIN, config, rows=batch, latent=latent, attention="reference")
    recipe = train_peak(RECIPE, config, rows=batch, latent=latent, attention="auto")
    ratio = plain["device"] / recipe["device"]
    rows = [Row(f"train_memory_reduction (batch {batch} per rank, {latent}x{latent} latents)", ratio, "x", ">= 5.6",
                ratio >= 5.6),
            Row("  plain device peak per rank (fp32, AdamW, materialised attention, 1 rank)",
                plain["device"] / 2**20, "MiB"),
            Row(f"  recipe device peak per rank ({RECIPE})", recipe["device"] / 2**20, "MiB"),
            Row("  recipe host bytes per rank (offloaded pieces, grads, AdamW state)", recipe["host"] / 2**20, "MiB")]
    for kind, v in sorted(plain["kinds"].items()):
        rows.append(Row(f"  plain peak of {kind}", v / 2**20, "MiB"))
    for kind, v in sorted(recipe["kinds"].items()):
        rows.append(Row(f"  recipe peak of {kind}", v / 2**20, "MiB"))
    rows += int8_rows(config)
    rows += sampling_rows(size)
    return report("diffusion", rows, json_path)

