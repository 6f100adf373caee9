"""``python -m cfx.bench diffusion``'s measurements on a tiny UNet: the recipe's device peak is below
plain training's by more than remat alone gives, the offloaded state sits on the host, and the
int8 bytes rows are the textbook ratios (fp16 -> int8 bounded by 2x, fp32 -> int8 by 4x)."""
from __future__ import annotations

import pytest

import cfx
from cfx.bench import diffusion as bench

TINY = cfx.diffusion.UNet2DConditionConfig(
    in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=64, attention_head_dim=4, norm_num_groups=8)


@pytest.mark.timeout(300)
def test_the_recipe_holds_a_fraction_of_plain_training():
    plain = bench.train_peak(bench.PLAIN, TINY, rows=4, latent=8, attention="reference")
    remat = bench.train_peak("data=1 remat=blocks", TINY, rows=4, latent=8, attention="reference")
    recipe = bench.train_peak(bench.RECIPE, TINY, rows=4, latent=8, attention="auto")
    assert recipe["device"] < remat["device"] < plain["device"]
    assert plain["device"] / recipe["device"] > 3
    assert recipe["host"] > 0 and plain["host"] == 0  # the offloaded AdamW state and pieces
    assert {"param", "optim"} <= set(plain["kinds"]) and "gathered" in recipe["kinds"]


def test_int8_rows_are_the_textbook_ratios():
    rows = {r.metric.split(" ")[0] if not r.metric.startswith(" ") else r.metric.strip(): r
            for r in bench.int8_rows(TINY)}
    fp16 = rows["int8_unet_bytes_reduction"].value
    fp32 = rows["fp32 / int8 UNet bytes"].value
    assert 1.8 < fp16 < 2.0 and 3.6 < fp32 < 4.0  # one byte per weight, plus scales and the fp16 rest
    assert rows["int8_unet_bytes_reduction"].ok == (fp16 >= 2.5)
