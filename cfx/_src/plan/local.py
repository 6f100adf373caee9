"""The single-device plan's program: one device and no mesh (``Plan.step(model, tx)`` without a
mesh), a ``TrainProgram`` (``protocol.py``) like a Plan's ``Program``.

Its state is ``TrainState(params, opt_state, frozen)`` of plain tensors. Activation checkpointing is per
block (``remat=blocks`` / ``dots``) or, under ``remat=auto``, one Rotor schedule over the blocks
within the plan's budget, solved for each batch shape the first time the step sees it.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from cfx._src.checkpoint import file as checkpoint_file, sharded as checkpoint_sharded
from cfx._src.core import random as jr
from cfx._src.generate.sample import sample_bytes
from cfx._src.models.parts import hook
from cfx._src.optim.base import apply_gradients, chain
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.nn.fp8_delayed import DelayedScaling, step_scope
from cfx._src.optim.fp8_meta import find_meta, replace_meta
from cfx._src.optim.loss_scale import loss_scale
from cfx._src.plan.build import check_clip_outside_scaling, check_model, rank_model, scheduled
from cfx._src.plan.protocol import TrainState
from cfx._src.plan.strategies.float8 import delayed_of, with_meta
from cfx._src.plan.strategy import Built
from cfx._src.precision.amp import Policy, policy as amp_policy
from cfx._src.transforms.autodiff import value_and_grad
from cfx._src.transforms.shapes import eval_shape


def train_step(model, tx, policy: Policy, delayed: DelayedScaling | None = None):
    """``step(params, opt_state, batch, key) -> (params, opt_state, loss)``: the loss in the policy's
    compute dtype (scaled for fp16), the update in fp32 master params; ``delayed``: each step in a float8
    ``step_scope`` of the meta in ``opt_state``, its amaxes into the meta after."""
    def scaled_loss(params, batch, key, scale):
        loss = model.loss(policy.cast_to_compute(params), *batch, key=key)
        return loss * scale, loss
    grad_fn = value_and_grad(scaled_loss, has_aux=True)

    def step(params, opt_state, batch, key):
        scale = loss_scale(opt_state) if policy.needs_loss_scaling else 1.0
        with step_scope(find_meta(opt_state)) if delayed else contextlib.nullcontext() as fp8_step:
            (_, loss), grads = grad_fn(params, tuple(batch), key, scale)
        params, opt_state = apply_gradients(tx, grads, opt_state, params)
        if delayed is not None:
            opt_state = replace_meta(opt_state, fp8_step.finish(delayed))
        return params, opt_state, loss

    return step


@torch.no_grad()
def evaluate(model, params, policy: Policy, batches) -> float:
    """The mean loss over ``batches`` (each a tuple of the model's batch tensors), without dropout."""
    p = policy.cast_to_compute(params)
    losses = [float(model.loss(p, *batch)) for batch in batches]
    return sum(losses) / len(losses)


class LocalProgram:
    """``plan`` (single-device: no mesh) applied to ``model`` and ``tx`` (module doc);
    ``grad_clip > 0`` clips by the global norm first."""

    def __init__(self, plan, model, tx, *, grad_clip: float = 0.0):
        if plan.mesh:
            raise ValueError(f"Plan {str(plan)!r} splits over the mesh axes {dict(plan.mesh)}; give its step a mesh "
                             "(plan.step(model, tx, mesh=plan.make_mesh())), or use the single-device plan.")
        check_model(plan, model)
        if grad_clip > 0:
            check_clip_outside_scaling(tx, eval_shape(model.init, jr.key(0)), f"Plan {str(plan)!r}")
            tx = chain(clip_by_global_norm(grad_clip), tx)
        self.policy, self._delayed = amp_policy(plan.precision), delayed_of(plan)
        tx = with_meta(plan, model, tx)
        self.plan, self.model, self.tx = plan, model, tx
        self._steps: dict[tuple, Any] = {}  # remat=auto: a schedule and its step per batch shape
        self._remat_plan = None
        self._step = None if plan.remat == "auto" else train_step(rank_model(plan, model), tx, self.policy, self._delayed)
        self._eval_model = rank_model(plan, model, blocks=False)  # (a float8 plan's blocks evaluate in float8)

    @property
    def remat_plan(self) -> Any:
        """``remat=auto``: the schedule of the last batch shape stepped (None before the first step)."""
        return self._remat_plan

    def init(self, key: torch.Tensor) -> TrainState:
        params = self.model.init(key)
        return TrainState(params, self.tx.init(params), hook(self.model, "frozen"))

    def init_from(self, params: Any) -> TrainState:
        """A state starting from ``params`` (pretrained weights), the optimizer's state fresh."""
        return TrainState(params, self.tx.init(params), hook(self.model, "frozen"))

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A state from the trees of a checkpoint."""
        return TrainState(params, opt_state, hook(self.model, "frozen"))

    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None) -> tuple[TrainState, dict]:
        """``(state, batch) -> (state, {"loss"})``: ``batch`` is ``(tokens, targets)``, or a
        ``check_train_batch`` model's own; ``key`` drives dropout."""
        batch = self._checked(batch)
        step = self._step if self._step is not None else self._solved(batch, key)
        params, opt_state, loss = step(state.params, state.opt_state, batch, key)
        return TrainState(params, opt_state, state.frozen), {"loss": loss}

    def _checked(self, batch: Any) -> tuple:
        check = hook(self.model, "check_train_batch")
        if check is not None:
            check(batch, f"Plan {str(self.plan)!r}")
        elif not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"Plan {str(self.plan)!r}: a batch is (tokens, targets), each a (B, T) integer tensor.")
        return tuple(batch)

    def _solved(self, batch: tuple, key) -> Any:
        """``remat=auto``: the fastest schedule whose activations fit the budget (Rotor) for this batch
        shape, solved on shapes the first time it comes, and its step."""
        shape = tuple(tuple(x.shape) for x in batch)
        if shape not in self._steps:  # the Remat strategy's solve, as a Plan's program asks it
            built = scheduled(self.plan, Built(self.plan, self.model, None, None), batch[0], key)
            self._steps[shape] = built.schedule, train_step(built.local, self.tx, self.policy, self._delayed)
        self._remat_plan, step = self._steps[shape]
        return step

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        """The model's loss on ``batch``, without dropout."""
        with step_scope(find_meta(state.opt_state)) if self._delayed else contextlib.nullcontext():
            return evaluate(self._eval_model, state.params, self.policy, [self._checked(batch)])

    def params(self, state: TrainState) -> Any:
        return state.params

    def save(self, directory: str, state: TrainState, *, metadata: dict | None = None) -> None:
        """``state`` in model coordinates (its params and optimizer state, whole tensors) as one of cfx's
        checkpoint directories, which any program of this model and optimizer loads."""
        checkpoint_sharded.save(directory, {"params": state.params, "opt_state": state.opt_state},
                                metadata=metadata or {})

    def load(self, directory: str, like: TrainState) -> tuple[TrainState, dict]:
        """``(state, metadata)`` from a checkpoint any program of this model and optimizer saved."""
        tree, meta = checkpoint_file.load(directory, {"params": like.params, "opt_state": like.opt_state})
        return TrainState(tree["params"], tree["opt_state"], like.frozen), meta

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        return sample_bytes(self.model, self.policy.cast_to_compute(state.params), prompt, steps=steps, key=key,
                            context=context)
