"""The training step on a mesh: data parallel over ``data``, Megatron tensor parallel over ``model``,
pipeline stages over ``pipe``.

Parallelism is applied in one readable order (torchtitan's habit): rules turn the model's
logical axes into specs, the blocks become tensor-parallel, and the step averages gradients
over ``data`` in one flat all-reduce and clips by the true global norm across shards.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx import optim
from cfx._src import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.mesh import Mesh
from cfx._src.mesh.spec import P
from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
from cfx._src.parallel.rules import Rules
from cfx._src.parallel.state import sharded_global_norm, state_specs, tree_pmean
from cfx._src.pipeline.api import pipeline
from cfx._src.shard_map import shard_map
from cfx._src.train.step import scaled_loss_grad

KNOWN_AXES = ("pipe", "data", "model")


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=2"`` -> ``{"data": 2, "model": 2}``."""
    shape = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in KNOWN_AXES or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS in {KNOWN_AXES}, "
                             "e.g. --mesh data=2,model=2.")
        shape[name] = int(size)
    return shape


def make_schedule(name: str, pipe: int, microbatches: int, chunks: int):
    """The ``--schedule`` for ``pipe`` ranks (ValueErrors name the fix)."""
    if name == "gpipe":
        return pipeline.gpipe(pipe, microbatches)
    if name == "1f1b":
        return pipeline.one_f_one_b(pipe, microbatches)
    if name == "interleaved":
        return pipeline.interleaved_1f1b(pipe, microbatches, chunks)
    if name == "zb-h1":
        return pipeline.zb_h1(pipe, microbatches)
    raise ValueError(f"--schedule {name!r}: expected gpipe, 1f1b, interleaved or zb-h1.")


def _pipelined_grad_fn(local_model, policy, schedule):
    """The pipeline's ``(loss, grads)`` in the shape of ``scaled_loss_grad`` (no loss scaling)."""
    run = pipeline(local_model, schedule)

    def grad_fn(params, tokens, targets, key, scale):
        del key, scale  # dropout is refused and fp16 scaling is refused up front
        loss, grads = run(policy.cast_to_compute(params), tokens, targets)
        grads = tree_util.map(lambda g, p: g.to(p.dtype), grads, params)
        return (loss, loss), grads
    return grad_fn


def make_sharded_train_step(model, tx, policy, mesh: Mesh, params: Any, opt_state: Any, *,
                            batch: int, grad_clip: float, wrap=lambda m: m, schedule=None):
    """A ``step(params, opt_state, tokens, targets, key)`` with the signature of the
    single-device one; params and optimizer state stay global between steps. With a ``pipe``
    axis, ``schedule`` (cfx.pipeline data) runs the blocks as stages over it."""
    if policy.needs_loss_scaling and (mesh.shape.get("model", 1) > 1 or "pipe" in mesh.shape):
        raise ValueError("--precision fp16 with a model or pipe axis: the loss scaler's inf/nan check "
                         "would see only this rank's part; use --precision bf16 (or fp32) with tensor "
                         "or pipeline parallelism for now.")
    if "pipe" in mesh.shape:
        if schedule is None:
            raise ValueError(f"{mesh!r} has a pipe axis: pass a schedule (--schedule, --microbatches).")
        if getattr(model.config, "dropout", 0.0) > 0:
            raise ValueError("--mesh with a pipe axis: pipeline stages run without dropout; use a "
                             "model preset with dropout 0.")
    data = mesh.shape.get("data", 1)
    if batch % data:
        raise ValueError(f"--batch {batch} is not divisible by the data axis size {data} of {mesh!r}; "
                         f"use a multiple of {data}.")
    rules = Rules({"batch": "data" if "data" in mesh.shape else None,
                   **({k: "model" for k in MEGATRON_RULES} if "model" in mesh.shape else {})})
    pspecs = rules.specs(model.axes(), mesh=mesh)
    sspecs = state_specs(opt_state, params, pspecs)
    # 1. tensor parallelism: every block split over `model` (embeddings and head replicated)
    local_model = tensor_parallel(model, "model") if "model" in mesh.shape else model
    # 2. then per-block strategies that wrap the tensor-parallel blocks (activation checkpointing)
    local_model = wrap(local_model)

    grad_fn = (_pipelined_grad_fn(local_model, policy, schedule) if "pipe" in mesh.shape
               else scaled_loss_grad(local_model, policy))

    def step(params, opt_state, tokens, targets, key):
        scale = optim.loss_scale(opt_state) if policy.needs_loss_scaling else 1.0
        (_, loss), grads = grad_fn(params, tokens, targets, key, scale)
        # 3. data parallelism: average gradients over `data` (equal shards: mean of the means)
        if "data" in mesh.shape:
            grads = tree_pmean(grads, "data")
            loss = lax.pmean(loss, "data")
        # 4. clip by the global norm over all shards (loss-scaled grads are unscaled first)
        if grad_clip > 0:
            norm = sharded_global_norm(grads, pspecs) / (scale if policy.needs_loss_scaling else 1.0)
            coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
            grads = tree_util.map(lambda g: g * coef, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    batch_spec = rules.spec(("batch", None))
    return shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, batch_spec, batch_spec, P()),
                     out_specs=(pspecs, sspecs, P()))
