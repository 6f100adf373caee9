"""The denoising objective trains as diffusers trains: 5 AdamW steps of ``cfx.diffusion`` 's UNet
on ``denoising_loss`` equal diffusers' ``UNet2DConditionModel`` trained with ``torch.optim.AdamW``
on the same loss (epsilon and v-prediction): in fp32 the losses at every step; in fp64 the params
after 5 steps, at the defaults (in fp32 Adam turns float noise in near-zero gradients into
lr-sized steps on a few elements); ``draw`` is a pure function of its key."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import cfx  # noqa: E402
from cfx._src.diffusion import train as T  # noqa: E402
from cfx._src.diffusion import unet as U  # noqa: E402

TINY = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16, attention_head_dim=4,
            norm_num_groups=8)
# the fp32 run's losses, diffusers' against cfx's over 5 AdamW steps (of order 1): measured 2.6e-7 relative
# worst over threads 1/2/4 and both xdist layouts; x12. The fp64 run: assert_close's fp64 defaults
FP32_LOSSES = dict(rtol=3e-6, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prediction, dtype", [("epsilon", torch.float32), ("v_prediction", torch.float64)],
                         ids=["epsilon-fp32", "v_prediction-fp64"])  # each target and each dtype once
def test_five_adamw_steps_equal_diffusers_with_torch_adamw(prediction, dtype):
    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**TINY).to(dtype)
    sched = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                    prediction_type=prediction)
    schedule = cfx.diffusion.Schedule.from_diffusers(sched)
    unet, params = U.from_diffusers(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    tx = cfx.optim.adamw(1e-3, weight_decay=1e-2)
    state = tx.init(params)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        latents = torch.randn(2, 4, 8, 8, generator=g, dtype=dtype)
        text = torch.randn(2, 5, 16, generator=g, dtype=dtype)
        t, noise = T.draw(schedule, cfx.random.key(step), latents)
        # diffusers' train_text_to_image.py, step for step
        noisy = sched.add_noise(latents, noise, t)
        want = noise if prediction == "epsilon" else sched.get_velocity(latents, noise, t)
        ref_loss = torch.nn.functional.mse_loss(ref(noisy, t, text).sample, want)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        loss, grads = cfx.value_and_grad(lambda p: T.denoising_loss(unet, schedule, p, latents, text, t, noise))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        torch.testing.assert_close(loss, ref_loss.detach(), **(FP32_LOSSES if dtype == torch.float32 else {}))
    if dtype == torch.float64:
        _, now = U.from_diffusers(ref)
        cfx.tree.assert_tree_close(params, now)


def test_draw_is_a_pure_function_of_its_key():
    schedule = cfx.diffusion.Schedule()
    x = torch.zeros(3, 4, 2, 2)
    t1, n1 = T.draw(schedule, cfx.random.key(5), x)
    t2, n2 = T.draw(schedule, cfx.random.key(5), x)
    assert torch.equal(t1, t2) and torch.equal(n1, n2) and n1.shape == x.shape
    assert t1.dtype == torch.int64 and 0 <= int(t1.min()) and int(t1.max()) < 1000
