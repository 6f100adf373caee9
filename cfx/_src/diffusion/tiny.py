"""``cfx.diffusion.tiny_pipeline(directory)``: a tiny random Stable Diffusion pipeline on disk, made by
cfx alone (no download, no diffusers), so the diffusion command lines can be tried offline in a minute::

    cfx.diffusion.tiny_pipeline("/tmp/tiny-sd")
    python -m cfx.diffusion.sample --pipeline /tmp/tiny-sd --prompt "a red square" --steps 4 --out a.png

It writes diffusers' layout (``save_pipeline``) and a ``tokenizer/`` that transformers'
``CLIPTokenizer`` reads: a character-level BPE vocabulary (no merges) of the lowercase letters, whose
ids fit the tiny text encoder. Its images are noise-shaped: the weights are random.
"""
from __future__ import annotations

import json
import os

from cfx._src.core import random
from cfx._src.diffusion.clip_text import CLIPTextConfig, CLIPTextEncoder
from cfx._src.diffusion.pipeline import Pipeline, save_pipeline
from cfx._src.diffusion.schedulers import Schedule
from cfx._src.diffusion.unet import UNet2DCondition
from cfx._src.diffusion.unet_config import UNet2DConditionConfig
from cfx._src.diffusion.vae import AutoencoderKL, AutoencoderKLConfig

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS = ["<|startoftext|>", "<|endoftext|>", *LETTERS, *(c + "</w>" for c in LETTERS)]


def tiny_pipeline(directory: str | os.PathLike, *, seed: int = 0) -> Pipeline:
    """Write a tiny random pipeline and its tokenizer to ``directory`` (module doc); returns it."""
    d = os.fspath(directory)
    unet = UNet2DCondition(UNet2DConditionConfig(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8))
    vae = AutoencoderKL(AutoencoderKLConfig.preset("tiny", norm_num_groups=16, sample_size=64))
    text = CLIPTextEncoder(CLIPTextConfig.preset("tiny", vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64,
                                                 max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                                                 pad_token_id=1))
    k_unet, k_vae, k_text = random.split(random.key(seed), 3)
    pipe = Pipeline(unet, unet.init(k_unet), vae, vae.init(k_vae), text, text.init(k_text), Schedule(), d)
    save_pipeline(d, pipe)
    _write_tokenizer(os.path.join(d, "tokenizer"), length=16)
    return pipe


def _write_tokenizer(path: str, *, length: int) -> None:
    """The files ``CLIPTokenizer.from_pretrained(path)`` reads (vocabulary, no merges, its config)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(TOKENS)}, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": length, "bos_token": TOKENS[0],
                   "eos_token": TOKENS[1], "pad_token": TOKENS[1], "unk_token": TOKENS[1]}, f)
