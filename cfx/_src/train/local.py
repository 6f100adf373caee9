"""The training job's names for the single-device program, which lives with the Plan
(``cfx._src.plan.local``: ``Plan.step(model, tx)`` without a mesh), and ``program_for``, the job's
choice between it and a Plan's program on a mesh."""
from __future__ import annotations

from typing import Any

from cfx._src.plan.local import LocalProgram, evaluate, train_step
from cfx._src.precision.amp import Policy

__all__ = ["LocalProgram", "evaluate", "make_train_step", "program_for"]


def make_train_step(model, tx, policy: Policy):
    """``step(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)``: the loss in
    the policy's compute dtype (scaled for fp16), the update in fp32 master params."""
    step = train_step(model, tx, policy)
    return lambda params, opt_state, tokens, targets, key: step(params, opt_state, (tokens, targets), key)


def program_for(plan: Any, model: Any, tx: Any, mesh: Any, *, nvme_dir: str | None = None,
                jit: bool | str = False) -> Any:
    """One device's program without a mesh, else the plan's (``jit``: each rank's step compiled)."""
    return plan.step(model, tx, mesh=mesh, nvme_dir=nvme_dir, jit=jit)
