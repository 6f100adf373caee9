# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stable Diffusion, tiny: train a UNet on shapes and sample it
#
# Stable Diffusion is three models and a schedule: a CLIP text encoder turns the caption into
# text states, a UNet predicts the noise (or velocity) in a noisy sample while attending to those
# states, and a VAE maps images to and from the latents the UNet works on. `cfx.diffusion` has all
# three as pure functions over params, and the schedule as pure functions of explicit state. This
# notebook trains a tiny UNet from scratch on generated 16x16 images of red squares and blue
# circles under a `cfx.parallel.Plan`, then samples both captions with DDIM and classifier-free
# guidance, a loop written out here.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P
from cfx.diffusion import CLIPTextConfig, CLIPTextEncoder, Denoiser, Schedule, UNet2DCondition, UNet2DConditionConfig

S = 16  # image side, pixels

# %% [markdown]
# ## Data
# 64 RGB images in [-1, 1], white background: even ones a red 7x7 square, odd ones a blue circle
# of radius 3.5, each at a random position.

# %%
CAPTIONS = ["a red square", "a blue circle"]
N = 64
g = torch.Generator().manual_seed(0)
labels = torch.arange(N) % 2                                     # (N,) index into CAPTIONS
cy, cx = torch.randint(4, S - 4, (2, N, 1, 1), generator=g)      # (N, 1, 1) centres
yy, xx = torch.arange(S).view(1, S, 1), torch.arange(S).view(1, 1, S)
square = ((yy - cy).abs() <= 3) & ((xx - cx).abs() <= 3)         # (N, S, S)
circle = (yy - cy) ** 2 + (xx - cx) ** 2 <= 3.5 ** 2
shape = torch.where(labels.view(N, 1, 1) == 0, square, circle)
colour = torch.tensor([[1.0, -1.0, -1.0], [-1.0, -1.0, 1.0]])[labels].view(N, 3, 1, 1)  # red, blue
images = torch.where(shape[:, None], colour, torch.ones(N, 3, S, S))  # (N, 3, S, S)


def show(images, titles, *, rows=1):
    cols = len(images) // rows
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.5 * rows), squeeze=False)
    for ax, im, title in zip(axes.flat, images, titles):
        ax.imshow((im.permute(1, 2, 0) / 2 + 0.5).clamp(0, 1))
        ax.set_title(title, fontsize=7)
        ax.set(xticks=[], yticks=[])
    plt.tight_layout()
    plt.show()


show(images[:8], [CAPTIONS[i] for i in labels[:8]])

# %% [markdown]
# ## Text states
# A CLIP text encoder of width 32 and two layers, with random weights. The token ids are made by
# hand, one per character (`a`-`z` are 1-26, space 27, start 28, end 29, padding 0), padded to 16;
# a real pipeline uses CLIP's tokenizer and SD's 77 positions. Untrained, the encoder still gives
# the two captions different states, which is all the UNet's cross-attention needs to tell them
# apart. The empty caption is the unconditional input guidance needs.

# %%
T = 16


def tokenize(text):
    ids = [ord(c) - ord("a") + 1 if c.isalpha() else 27 for c in text]
    return [28, *ids, 29] + [0] * (T - 2 - len(ids))


clip_config = CLIPTextConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=T, eos_token_id=29)
clip = CLIPTextEncoder(clip_config)
tokens = torch.tensor([tokenize(c) for c in [*CAPTIONS, ""]])  # (3, T)
with torch.no_grad():
    states, _ = clip.apply(clip.init(cfx.random.key(0)), tokens)  # (3, T, 32): square, circle, empty
print("text states", tuple(states.shape), "| square vs circle, relative distance",
      f"{float((states[0] - states[1]).norm() / states[0].norm()):.2f}")

# %% [markdown]
# ## The UNet and its objective
# A `UNet2DCondition` with two resolutions (16 channels at 16x16, 32 at 8x8; cross-attention to
# the text in the 16x16 blocks and the middle block) working directly on pixels:
# `in_channels = out_channels = 3`. A latent diffusion pipeline puts a VAE around it
# (`cfx.diffusion.AutoencoderKL`) and runs the same UNet on its 4-channel latents.
# `Denoiser(unet, schedule)` is the training objective as a model a Plan trains. The schedule is
# SD's, with SD 2's velocity target (`v_prediction`): at high noise the velocity is close to the
# clean image (negated), which a tiny model learns much faster than the noise itself; with SD 1's
# noise target the same 80 steps give samples that are still mostly noise.

# %%
unet_config = UNet2DConditionConfig(
    sample_size=S, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8)
model = Denoiser(UNet2DCondition(unet_config), Schedule(prediction_type="v_prediction"))
print(f"{sum(p.numel() for p in cfx.tree.leaves(model.init(cfx.random.key(1)))):,} UNet params,",
      len(model.blocks), "blocks (resnets and transformers)")

# %% [markdown]
# ## Training under a Plan
# Two data-parallel ranks, each taking half of every batch. A batch is `(images, text_states, t,
# noise)`; `cfx.diffusion.draw` makes `t` and the noise from a key outside the step, so any plan
# computes the numbers one device would. The UNet's resnets and transformers are the Denoiser's
# blocks, so `zero=3` gathers them one at a time and `remat=blocks` recomputes each in the
# backward; at this size they only add time. One caption in ten is replaced by the empty one, so
# the same model also learns the unconditional prediction guidance needs.

# %%
B, STEPS = 16, 80
plan = cfx.parallel.Plan.parse("data=2")
with plan.make_mesh() as mesh:
    step = plan.step(model, cfx.optim.adamw(3e-3), mesh=mesh)
    state = step.init(cfx.random.key(1))
    for i in range(STEPS):
        k_rows, k_drop, k_noise = cfx.random.split(cfx.random.key(100 + i), 3)
        rows = cfx.random.randint(k_rows, (B,), 0, N)
        text = torch.where((cfx.random.uniform(k_drop, (B,)) < 0.1).view(B, 1, 1), states[2], states[labels[rows]])
        x = images[rows]
        state, metrics = step(state, (x, text, *cfx.diffusion.draw(model.schedule, k_noise, x)))
        if i % 20 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(metrics['loss']):.3f}")
    params = step.params(state)  # the UNet's params tree, whole tensors

# %% [markdown]
# ## Sampling
# DDIM over 20 of the 1000 training timesteps, from Gaussian noise. Each step runs the UNet once
# on the noisy batch stacked twice, one copy with the empty caption's states and one with the
# captions', and mixes the two predictions with classifier-free guidance (scale 3) before the
# DDIM update. The same loop, with the VAE's decoder at the end, is `cfx.diffusion.sample_images`.
# Here it runs under `shard_map` on a `data` axis of 2, each rank denoising half of the samples.

# %%
def ddim(params, x, cond, uncond, *, steps=20, scale=3.0):
    schedule = model.schedule
    ts = cfx.diffusion.ddim_timesteps(schedule, steps).tolist()
    with torch.no_grad():  # in the rank's own thread: grad mode is per thread
        for t, prev in zip(ts, [*ts[1:], -1]):
            out_uncond, out_cond = model.apply(params, torch.cat([x, x]), t, torch.cat([uncond, cond])).chunk(2)
            x, _ = cfx.diffusion.ddim_step(schedule, cfx.diffusion.guidance(out_uncond, out_cond, scale), t, prev, x)
    return x


n = 6  # samples per caption
cond = states[torch.arange(2).repeat_interleave(n)]  # (2n, T, 32): n squares, then n circles
uncond = states[2].expand_as(cond)
noise = cfx.random.normal(cfx.random.key(5), (2 * n, 3, S, S))
with cfx.Mesh({"data": 2}) as mesh:
    split = P("data")
    samples = cfx.device_get(cfx.shard_map(ddim, mesh=mesh, in_specs=(P(), split, split, split), out_specs=split)(
        params, noise, cond, uncond))
show(samples, [CAPTIONS[i] for i in range(2) for _ in range(n)], rows=2)

# %% [markdown]
# After 80 steps of batch 16 the model has learnt what the captions say about colour, and
# roughly how big a shape is and that there is one: a red blob for one caption, a blue one for
# the other, on a white background with speckles of noise left in it. Crisp edges, square corners
# against round outlines and a clean background take far longer training.
