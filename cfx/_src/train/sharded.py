"""The training step on a mesh: data parallel over ``data``, Megatron tensor parallel over ``model``,
pipeline stages over ``pipe`` -- with params and optimizer state kept as ShardedArrays.

Parallelism is applied in one readable order (torchtitan's habit): rules turn the model's
logical axes into specs, the blocks become tensor-parallel, and the step averages gradients
over ``data`` in one flat all-reduce and clips by the true global norm across shards.

State never exists as one global tensor: ``init`` builds each process's blocks directly
(``init_sharded``), each step takes the ShardedArrays and gives back new ones whose blocks are
written into the old buffers (the inputs are donated), and eval and sampling run sharded too.
"""
from __future__ import annotations

from typing import Any

import torch

from cfx import optim
from cfx._src import donation
from cfx._src import tree as tree_util
from cfx._src.init_sharded import init_sharded
from cfx._src.lax import collectives as lax
from cfx._src.mesh.mesh import Mesh
from cfx._src.mesh.spec import P, is_spec
from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
from cfx._src.parallel.rules import Rules
from cfx._src.parallel.state import sharded_global_norm, state_specs, tree_pmean
from cfx._src.pipeline.api import pipeline
from cfx._src.shapes import eval_shape
from cfx._src.shard_map import shard_map
from cfx._src.arrays import device_put
from cfx._src.train.sample import sample_bytes
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


class ShardedTrainStep:
    """``step(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)`` on a mesh,
    with the signature of the single-device step; params and optimizer state are ShardedArrays
    (``init`` / ``put`` make them) and are donated: the step's outputs reuse their buffers."""

    def __init__(self, model, tx, policy, mesh: Mesh, *, batch: int, grad_clip: float, wrap=lambda m: m,
                 schedule=None):
        _check(model, policy, mesh, batch, schedule)
        self.model, self.tx, self.policy, self.mesh = model, tx, policy, mesh
        self.rules = Rules({"batch": "data" if "data" in mesh.shape else None,
                            **({k: "model" for k in MEGATRON_RULES} if "model" in mesh.shape else {})})
        self.param_specs = self.rules.specs(model.axes(), mesh=mesh)
        self.param_shapes = eval_shape(model.init, torch.zeros(2, dtype=torch.int64))
        self.state_specs = state_specs(eval_shape(tx.init, self.param_shapes), self.param_shapes,
                                       self.param_specs)
        # 1. tensor parallelism: every block split over `model` (embeddings and head replicated)
        local_model = self.eval_model = tensor_parallel(model, "model") if "model" in mesh.shape else model
        # 2. then per-block strategies that wrap the tensor-parallel blocks (activation checkpointing)
        local_model = wrap(local_model)
        grad_fn = (_pipelined_grad_fn(local_model, policy, schedule) if "pipe" in mesh.shape
                   else scaled_loss_grad(local_model, policy))
        pspecs = self.param_specs

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
            with donation.donated(tree_util.leaves(grads)):  # spent: the update may reuse them
                updates, opt_state = tx.update(grads, opt_state, params)
            return optim.apply_updates(params, updates), opt_state, loss

        batch_spec = self.rules.spec(("batch", None))
        self._step = shard_map(step, mesh=mesh, in_specs=(pspecs, self.state_specs, batch_spec, batch_spec, P()),
                               out_specs=(pspecs, self.state_specs, P()), donate_argnums=(0, 1))
        self._loss = shard_map(self._eval_loss, mesh=mesh, in_specs=(pspecs, batch_spec, batch_spec),
                               out_specs=P())
        self.batch_spec = batch_spec

    def __call__(self, params, opt_state, tokens, targets, key):
        return self._step(params, opt_state, tokens, targets, key)

    # -- state -------------------------------------------------------------------------------
    def init(self, key: torch.Tensor) -> tuple[Any, Any]:
        """``(params, opt_state)`` as ShardedArrays; no process holds more than its blocks plus
        one parameter leaf at a time."""
        params = init_sharded(self.model.init, key, mesh=self.mesh, specs=self.param_specs)
        return params, self.init_state(params)

    def init_state(self, params: Any) -> Any:
        return shard_map(self.tx.init, mesh=self.mesh, in_specs=(self.param_specs,),
                         out_specs=self.state_specs)(params)

    def put(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Global trees (a checkpoint) laid out as this step's ShardedArrays."""
        return _put_tree(params, self.param_specs, self.mesh), _put_tree(opt_state, self.state_specs, self.mesh)

    # -- eval and sampling, sharded like the step ---------------------------------------------
    def _eval_loss(self, params, tokens, targets):
        with torch.no_grad():
            loss = self.eval_model.loss(self.policy.cast_to_compute(params), tokens, targets)
        return lax.pmean(loss, "data") if "data" in self.mesh.shape else loss

    def loss(self, params, tokens, targets) -> float:
        """The model's loss on a global batch (split over ``data``), without dropout."""
        return float(self._loss(params, tokens, targets))

    def sample(self, params, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """``sample_bytes`` with the tensor-parallel model on every rank (same key: same text)."""
        model, policy = self.eval_model, self.policy

        def logits(p, tokens):  # vocab-parallel logits (B, T, V/n) -> (B, T, V)
            out = model.apply(p, tokens)
            return lax.all_gather(out, "model", dim=-1, tiled=True) if "model" in self.mesh.shape else out
        run = shard_map(lambda p: sample_bytes(model, policy.cast_to_compute(p), prompt, steps=steps, key=key,
                                               context=context, logits=logits),
                        mesh=self.mesh, in_specs=(self.param_specs,), out_specs=P())
        return run(params)


def _put_tree(tree: Any, specs: Any, mesh: Mesh) -> Any:
    leaves, treedef = tree_util.flatten(tree)
    spec_leaves = tree_util.leaves(specs, is_leaf=is_spec)
    return tree_util.unflatten(treedef, [device_put(x, mesh, s) for x, s in zip(leaves, spec_leaves)])


def _check(model, policy, mesh: Mesh, batch: int, schedule) -> None:
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


def make_sharded_train_step(model, tx, policy, mesh: Mesh, *, batch: int, grad_clip: float,
                            wrap=lambda m: m, schedule=None) -> ShardedTrainStep:
    """The mesh's train step (``ShardedTrainStep``); see its doc."""
    return ShardedTrainStep(model, tx, policy, mesh, batch=batch, grad_clip=grad_clip, wrap=wrap,
                            schedule=schedule)
