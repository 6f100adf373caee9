"""A Stable Diffusion pipeline directory (diffusers' layout) read into cfx models and written back.

::

    pipe/
      unet/          config.json + diffusion_pytorch_model.safetensors (or sharded, with its .index.json)
      vae/           config.json + diffusion_pytorch_model.safetensors
      text_encoder/  config.json + model.safetensors            (transformers' CLIPTextModel)
      scheduler/     scheduler_config.json
      tokenizer/     (used by the CLIs when present; never read here)

``load_pipeline(directory)`` returns a ``Pipeline`` of the three models with their params and the
``Schedule``; ``save_pipeline(directory, pipeline)`` writes the same layout, which diffusers'
``from_pretrained`` (per component) and transformers' ``CLIPTextModel.from_pretrained`` load. Only
safetensors weights are read (a ``.bin`` pickle is refused: convert it with diffusers first).
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any

from cfx._src.diffusion import clip_text, unet, vae
from cfx._src.diffusion.schedulers import Schedule


@dataclasses.dataclass
class Pipeline:
    unet: Any
    unet_params: Any
    vae: Any
    vae_params: Any
    text_encoder: Any
    text_params: Any
    schedule: Schedule
    directory: str | None = None      # where it was read from (its tokenizer/ lives there)


def load_pipeline(directory: str | os.PathLike) -> Pipeline:
    """The pipeline in ``directory`` (module doc); a missing part is a ValueError naming it."""
    d = os.fspath(directory)
    u_cfg = _json(d, "unet", "config.json")
    unet_model, unet_params = unet.from_diffusers(_weights(d, "unet", "diffusion_pytorch_model"), config=u_cfg)
    vae_model, vae_params = vae.from_diffusers(_weights(d, "vae", "diffusion_pytorch_model"),
                                               config=_json(d, "vae", "config.json"))
    t_cfg = clip_text.config_from_hf(types.SimpleNamespace(**_json(d, "text_encoder", "config.json")))
    text_model, text_params = clip_text.from_hf(_weights(d, "text_encoder", "model"), config=t_cfg)
    schedule = Schedule.from_diffusers(_json(d, "scheduler", "scheduler_config.json"))
    _check_parts_fit(d, unet_model, vae_model, text_model)
    return Pipeline(unet_model, unet_params, vae_model, vae_params, text_model, text_params, schedule, d)


def _check_parts_fit(d: str, u: Any, v: Any, t: Any) -> None:
    """ValueError naming both config files when the UNet cannot take the VAE's latents or the text
    encoder's states (components of two different pipelines)."""
    uc, vc, width = u.config, v.config, t.config.hidden_size
    unet_cfg = os.path.join(d, "unet", "config.json")
    if uc.in_channels != vc.latent_channels or uc.out_channels != vc.latent_channels:
        raise ValueError(f"load_pipeline: {unet_cfg!r} takes and predicts {uc.in_channels} / {uc.out_channels} "
                         f"channels, but {os.path.join(d, 'vae', 'config.json')!r} makes latents of "
                         f"{vc.latent_channels}; the two come from different pipelines: use the VAE the UNet was "
                         "trained with.")
    cross = uc.per_block("cross_attention_dim")[0]
    if cross != width:
        raise ValueError(f"load_pipeline: {unet_cfg!r} cross-attends to states of width {cross}, but "
                         f"{os.path.join(d, 'text_encoder', 'config.json')!r} has hidden_size {width}; the two come "
                         "from different pipelines: use the text encoder the UNet was trained with.")


def save_pipeline(directory: str | os.PathLike, p: Pipeline) -> None:
    """``p`` in diffusers' layout (module doc), each weights file written atomically."""
    from safetensors.torch import save_file

    from cfx._src.checkpoint.io import cpu_unshared, write_atomic
    d = os.fspath(directory)
    parts = {
        "unet": ({"_class_name": "UNet2DConditionModel", **dataclasses.asdict(p.unet.config)},
                 unet.to_diffusers_state_dict(p.unet, p.unet_params), "diffusion_pytorch_model"),
        "vae": ({"_class_name": "AutoencoderKL", **p.vae.config.to_diffusers()},
                vae.to_diffusers_state_dict(p.vae, p.vae_params), "diffusion_pytorch_model"),
        "text_encoder": (_clip_config(p.text_encoder.config),
                         clip_text.to_hf_state_dict(p.text_encoder, p.text_params), "model"),
    }
    for name, (config, state, stem) in parts.items():
        os.makedirs(os.path.join(d, name), exist_ok=True)
        tensors = cpu_unshared(state)
        write_atomic(os.path.join(d, name, stem + ".safetensors"), lambda tmp, t=tensors: save_file(t, tmp))
        _dump(os.path.join(d, name, "config.json"), config)
    s = p.schedule
    os.makedirs(os.path.join(d, "scheduler"), exist_ok=True)
    _dump(os.path.join(d, "scheduler", "scheduler_config.json"), {
        "_class_name": "DDIMScheduler", "num_train_timesteps": s.num_train_timesteps, "beta_start": s.beta_start,
        "beta_end": s.beta_end, "beta_schedule": s.beta_schedule, "prediction_type": s.prediction_type,
        "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1})


def tokenizer(directory: str, length: int):
    """``text -> (1, length) token ids`` with the pipeline directory's ``tokenizer/`` (transformers'
    ``CLIPTokenizer``, padded to ``length``), for the CLIs."""
    path = os.path.join(directory, "tokenizer")
    if not os.path.isdir(path):
        raise ValueError(f"--pipeline {directory!r} has no tokenizer/ directory; save the pipeline's tokenizer there "
                         "(tokenizer.save_pretrained(DIR + '/tokenizer')).")
    try:
        import transformers
    except ImportError:
        raise ValueError("reading the pipeline's tokenizer needs transformers: pip install transformers.") from None
    tok = transformers.CLIPTokenizer.from_pretrained(path)
    return lambda text: tok(text, padding="max_length", max_length=min(length, tok.model_max_length), truncation=True,
                            return_tensors="pt").input_ids


def _clip_config(c: Any) -> dict:
    return {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "max_position_embeddings": c.max_position_embeddings, "hidden_act": c.hidden_act,
            "layer_norm_eps": c.layer_norm_eps, "initializer_range": c.init_std, "eos_token_id": c.eos_token_id,
            "bos_token_id": c.bos_token_id, "pad_token_id": c.pad_token_id, "attention_dropout": 0.0,
            "projection_dim": c.hidden_size, "torch_dtype": "float32"}


def _json(d: str, part: str, name: str) -> dict:
    path = os.path.join(d, part, name)
    if not os.path.exists(path):
        raise ValueError(f"load_pipeline: {path!r} is missing; {d!r} is not a Stable Diffusion pipeline directory "
                         "(unet/, vae/, text_encoder/, scheduler/ as diffusers' save_pretrained writes them).")
    with open(path) as f:
        return json.load(f)


def _weights(d: str, part: str, stem: str) -> dict:
    """A component's tensors from ``stem.safetensors`` or its sharded index."""
    from safetensors.torch import load_file
    folder = os.path.join(d, part)
    whole, index = os.path.join(folder, stem + ".safetensors"), os.path.join(folder, stem + ".safetensors.index.json")
    if os.path.exists(whole):
        return load_file(whole)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out: dict = {}
        for name in files:
            out.update(load_file(os.path.join(folder, name)))
        return out
    bins = [n for n in os.listdir(folder)] if os.path.isdir(folder) else []
    hint = (" It holds pickled .bin weights; convert them with diffusers (save_pretrained(..., safe_serialization=True))."
            if any(n.endswith(".bin") for n in bins) else "")
    raise ValueError(f"load_pipeline: no {stem}.safetensors in {folder!r}.{hint}")


def _dump(path: str, obj: Any) -> None:
    from cfx._src.checkpoint.io import write_atomic

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    write_atomic(path, write)
