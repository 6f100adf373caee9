"""LoRA (Hu et al., 2021) as a transform of params: low-rank adapters beside frozen Linear weights.

``cfx.lora.init(model, config, key)`` makes the adapters (an ordinary params pytree: ``A`` ``(in, r)``
drawn as peft draws it, ``B`` ``(r, out)`` zero) for the Linear weights ``config.targets`` pick;
``attach(params, adapters, config)`` puts a ``LoraWeight`` where each of them was, which
``cfx.nn.Linear`` runs as ``x @ w (+ b) + alpha / r * (x A) B`` without forming the merged weight. The
base may be int8 (``cfx.quant.quantize``: QLoRA's recipe) or bf16 beside fp32 adapters. Train the
adapters alone::

    loss, grads = cfx.value_and_grad(
        lambda ad: model.loss(cfx.lora.attach(params, ad, config), tokens, targets))(adapters)

``frozen_base(params, model.axes(), "int8" | "bf16" | ...)`` makes the frozen base one recipe for every
model. ``merge`` / ``unmerge`` fold them into the weights and back; ``save_peft`` / ``load_peft`` write and read
peft's ``adapter_config.json`` + ``adapter_model.safetensors`` (GPT-2, Llama, OPT). ``save_diffusers`` /
``load_diffusers`` write and read the adapters of a Stable Diffusion pipeline's UNet (preset
``"unet-attn"``) and text encoder (``"attn"``) as diffusers' ``pytorch_lora_weights.safetensors``, which
``StableDiffusionPipeline.load_lora_weights`` loads.

For tensor and pipeline parallelism the adapters over a frozen base are a model of their own:
``lora_model(model, config, frozen)`` (a ``LoraModel``) has the adapters for params, each ``A`` split
like its base weight's input dim and ``B`` like its output under a ``model`` axis, each block attaching
its own frozen block, so any Plan trains it (``python -m cfx.train --lora`` does).
``place_base(lm, plan, mesh)`` keeps its frozen base as the Plan keeps its state: sharded over ``data``
under ZeRO-3, each pipe stage holding only the blocks it runs, in host memory or files with ``offload``
(``plan.step`` does it itself; the placed base is the program's ``TrainState.frozen``).
"""
from cfx._src.diffusion.lora import load_diffusers, save_diffusers
from cfx._src.lora.adapters import attach, axes, init, merge, unmerge
from cfx._src.lora.config import ALL_LINEAR, PRESETS, LoraConfig
from cfx._src.lora.frozen import frozen_base
from cfx._src.lora.model import LoraModel
from cfx._src.lora.peft import load_peft, save_peft
from cfx._src.nn.lora_weight import LoraWeight
from cfx._src.plan.lora_base import place_base
from cfx._src.train.model import lora_model

__all__ = ["ALL_LINEAR", "LoraConfig", "LoraModel", "LoraWeight", "PRESETS", "attach", "axes", "frozen_base", "init",
           "load_diffusers", "load_peft", "lora_model", "merge", "place_base", "save_diffusers", "save_peft",
           "unmerge"]
