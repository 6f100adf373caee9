"""The trivial plan's program: one device and no mesh, with what the train loop asks of a Plan's
``Program`` (``init``, ``put``, the step, ``loss``, ``params``, ``sample``, ``remat_plan``).

Its state is ``TrainState(params, opt_state)`` of plain tensors. Activation checkpointing is per
block (``remat=blocks`` / ``dots``) or, under ``remat=auto``, one Rotor schedule over the blocks
within the plan's budget, solved on the first batch as a Plan's program solves its own.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.generate.sample import sample_bytes
from cfx._src.optim.base import apply_gradients
from cfx._src.optim.loss_scale import loss_scale
from cfx._src.plan.build import remat_blocks
from cfx._src.plan.program import TrainState
from cfx._src.precision.amp import Policy, policy as amp_policy
from cfx._src.remat.plan import solve as solve_chain
from cfx._src.transforms.autodiff import value_and_grad
from cfx._src.transforms.shapes import eval_shape


def make_train_step(model, tx, policy: Policy):
    """``step(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)``: the loss in
    the policy's compute dtype (scaled for fp16), the update in fp32 master params."""
    def scaled_loss(params, tokens, targets, key, scale):
        loss = model.loss(policy.cast_to_compute(params), tokens, targets, key=key)
        return loss * scale, loss
    grad_fn = value_and_grad(scaled_loss, has_aux=True)

    def step(params, opt_state, tokens, targets, key):
        scale = loss_scale(opt_state) if policy.needs_loss_scaling else 1.0
        (_, loss), grads = grad_fn(params, tokens, targets, key, scale)
        params, opt_state = apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    return step


@torch.no_grad()
def evaluate(model, params, policy: Policy, batches) -> float:
    """The mean loss over ``batches`` of ``(tokens, targets)``, without dropout."""
    p = policy.cast_to_compute(params)
    losses = [float(model.loss(p, x, y)) for x, y in batches]
    return sum(losses) / len(losses)


class LocalProgram:
    """``plan`` (single-device: no mesh) applied to ``model`` and ``tx`` (module doc)."""

    def __init__(self, plan, model, tx):
        assert not plan.mesh, f"LocalProgram runs the single-device plan, not {plan}"
        self.plan, self.model, self.tx = plan, model, tx
        self.policy = amp_policy(plan.precision)
        self.remat_plan = None  # remat=auto: the Rotor schedule, solved on the first batch
        self._step = None if plan.remat == "auto" else make_train_step(remat_blocks(model, plan.remat), tx,
                                                                        self.policy)

    def init(self, key: torch.Tensor) -> TrainState:
        params = self.model.init(key)
        return TrainState(params, self.tx.init(params))

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A state from the trees of a checkpoint."""
        return TrainState(params, opt_state)

    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None) -> tuple[TrainState, dict]:
        """``(state, (tokens, targets)) -> (state, {"loss"})``; ``key`` drives dropout."""
        tokens, targets = batch
        if self._step is None:
            self._solve_remat(tokens, key)
        params, opt_state, loss = self._step(*state, tokens, targets, key)
        return TrainState(params, opt_state), {"loss": loss}

    def _solve_remat(self, tokens: torch.Tensor, key) -> None:
        """``remat=auto``: the fastest schedule whose activations fit the budget (Rotor), on shapes."""
        meta = tree_util.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"),
                             eval_shape(self.model.init, jr.key(0)))
        _, self.remat_plan = solve_chain(self.model, meta, tokens, budget=self.plan.remat_budget, key=key)
        self._step = make_train_step(dataclasses.replace(self.model, remat_plan=self.remat_plan), self.tx,
                                     self.policy)

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        """The model's loss on ``(tokens, targets)``, without dropout."""
        return evaluate(self.model, state.params, self.policy, [batch])

    def params(self, state: TrainState) -> Any:
        return state.params

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        return sample_bytes(self.model, self.policy.cast_to_compute(state.params), prompt, steps=steps, key=key,
                            context=context)


def program_for(plan: Any, model: Any, tx: Any, mesh: Any, *, nvme_dir: str | None = None,
                jit: bool | str = False) -> Any:
    """One device's program without a mesh, else the plan's (``jit``: each rank's step compiled)."""
    if mesh is None:
        if jit:
            raise ValueError("jit=True compiles a Plan's step on a mesh; give the plan an axis (e.g. 'data=1') "
                             "or drop jit.")
        return LocalProgram(plan, model, tx)
    return plan.step(model, tx, mesh=mesh, nvme_dir=nvme_dir, jit=jit)
