"""The training job's model and optimizer, as its flags name them: a byte-level ``--model`` /
``--preset`` decoder, and AdamW with warmup and cosine decay (weight decay on matrices only).

Under ``--lora`` the model the job trains is a ``cfx.lora`` ``LoraModel``: the adapters over a frozen
base (``lora_model``), stored as ``--lora-base`` says (``job_base``), split over a model axis by
Megatron's rules (``megatron_split``)."""
from __future__ import annotations

from typing import Any

from cfx._src.core import tree as tree_util
from cfx._src.core.tree import is_axes_leaf
from cfx._src.lora.config import LoraConfig
from cfx._src.lora.frozen import frozen_base
from cfx._src.lora.model import LoraModel
from cfx._src.models import families
from cfx._src.models.parts import max_length
from cfx._src.models.vocab_pad import pad_vocab
from cfx._src.optim.alias import adamw
from cfx._src.optim.base import GradientTransformation, chain, identity
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.optim.loss_scale import dynamic_loss_scale
from cfx._src.optim.schedules import warmup_cosine_decay_schedule
from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
from cfx._src.parallel.rules import Rules
from cfx._src.plan.config import parse_mesh
from cfx._src.precision.amp import policy
from cfx._src.train.config import MESH_FIX, TrainConfig
from cfx._src.train.data import VOCAB_SIZE


def build_model(cfg: TrainConfig) -> Any:
    """``--model`` (a family's name: ``families.trained()``) at ``--preset`` over bytes, its vocabulary
    padded as ``--pad-vocab`` says; ValueError unless ``--seq`` fits its context."""
    model = families.named(cfg.model, "--model").preset(cfg.preset, vocab_size=VOCAB_SIZE)
    return check_context(cfg, padded_vocab(cfg, model), f"{cfg.model} {cfg.preset!r}")


def padded_vocab(cfg: TrainConfig, model: Any, params: Any = None) -> Any:
    """``model`` (and ``params``) with the vocabulary ``--pad-vocab`` pads (``cfx.models.pad_vocab``): to
    a multiple of N, or under ``auto`` to a multiple of 64 x the ``--mesh`` model axis where that axis
    does not split it (Megatron-LM's rounding; 64 keeps the head's matmul tiles whole)."""
    multiple = _pad_multiple(cfg, model)
    if multiple is None:
        return model if params is None else (model, params)
    return pad_vocab(model, params, multiple=multiple)


def _pad_multiple(cfg: TrainConfig, model: Any) -> int | None:
    if cfg.pad_vocab is None:
        return None
    if cfg.pad_vocab != "auto":
        return int(cfg.pad_vocab)
    n = dict(parse_mesh(cfg.mesh, fix=MESH_FIX)).get("model", 1) if cfg.mesh else 1
    return None if model.config.vocab_size % n == 0 else 64 * n


def check_context(cfg: TrainConfig, model: Any, what: str) -> Any:
    """``model``, or a ValueError unless ``--seq`` fits its context (``what`` names it)."""
    max_len = max_length(model)
    if max_len is not None and cfg.seq > max_len:
        raise ValueError(f"--seq {cfg.seq} exceeds the {what} context of {max_len}; use --seq {max_len} or less.")
    return model


def megatron_split(model: Any, axis: str) -> tuple[Any, Any]:
    """``model`` Megatron tensor-parallel over ``axis`` and its params' specs under it (how a
    ``LoraModel`` splits its frozen base: each rank runs on its block of it)."""
    tp = tensor_parallel(model, axis)
    rules = {k: axis for k in MEGATRON_RULES if k != "vocab" or getattr(tp, "logits_axis", None) is not None}
    return tp, Rules(rules).specs(model.axes())


def lora_model(model: Any, config: LoraConfig, base: Any) -> LoraModel:
    """The adapters ``config`` puts on ``model`` over its frozen params ``base``, as a model a Plan
    trains on any mesh (``cfx._src.lora.model``; a model axis splits it as ``megatron_split``)."""
    return LoraModel(model, config, base, split=megatron_split)


def job_base(cfg: TrainConfig, model: Any, params: Any) -> Any:
    """``params`` as ``--lora-base`` stores the frozen base (``cfx.lora.frozen_base``): ``int8`` Linear
    weights, every other floating leaf in ``--precision``'s compute dtype (the adapters compute in it
    beside them)."""
    return frozen_base(params, model.axes(), "int8" if cfg.lora_base == "int8" else cfg.precision,
                       dtype=policy(cfg.precision).compute_dtype)


def decay_mask(model) -> Any:
    """Weight decay on matrices only (leaves with two logical axes; not biases, norms), as a
    function of the params so it fits the model's tree and a Plan's stacked layout alike."""
    axes = model.axes()

    def mask(params: Any) -> Any:
        blocks = params.get("blocks")
        if not isinstance(blocks, list):  # a pipe Plan's stacked blocks
            tree = {**axes, "blocks": axes["blocks"][0]}
        elif len(blocks) != len(axes["blocks"]):  # a pipe stage's own blocks (all alike under a Plan)
            tree = {**axes, "blocks": [axes["blocks"][0]] * len(blocks)}
        else:
            tree = axes
        return tree_util.map(lambda names: len(names) >= 2, tree, is_leaf=is_axes_leaf)
    return mask


def build_schedule(cfg: TrainConfig):
    """The learning rate of each optimizer step: ``--warmup`` steps up to ``--lr``, then cosine
    decay to ``--lr * --min-lr-ratio`` at ``--steps``."""
    return warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup, cfg.steps),
        decay_steps=max(cfg.steps, 1), end_value=cfg.lr * cfg.min_lr_ratio)


def build_optimizer(cfg: TrainConfig, model, *, clip_slot: bool = True) -> GradientTransformation:
    """AdamW with warmup + cosine after a global-norm clip (``--grad-clip``), inside fp16's loss
    scaling (the clip sees the unscaled grads). Every program runs this same optimizer -- on a mesh
    the clip's norm spans every shard (``cfx.optim.sharded``) -- so its state over the model's params
    is a checkpoint's ``opt_state`` whatever the mesh (``saving``). The clip keeps its place as
    ``identity`` under ``--grad-clip 0``: the state's structure depends on the model and the
    precision only. ``clip_slot=False``: the chain without that place, as runs before it saved
    (``saving`` reads their checkpoints)."""
    parts = [adamw(build_schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask(model))]
    if clip_slot:
        parts.insert(0, clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else identity())
    tx = chain(*parts)
    if policy(cfg.precision).needs_loss_scaling:
        tx = dynamic_loss_scale(tx)
    return tx
