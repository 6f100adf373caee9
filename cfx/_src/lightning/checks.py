"""What a cfx ``Strategy`` refuses, each with a one-line ValueError naming the alternative, and
Lightning's precision flags as cfx's policies.

A cfx model's params are a pytree that the Plan's program owns: it runs the forward, the
backward and the optimizer's update in one step. So a Lightning feature that works on the
``torch.nn`` parameters of the LightningModule, their ``.grad`` or a ``torch.optim`` optimizer
-- manual optimisation, other optimizers, the gradient hooks, callbacks that freeze, prune or
average parameters -- would find nothing to act on; it is refused before the first step rather
than silently ignored.
"""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (BaseFinetuning, GradientAccumulationScheduler, LearningRateMonitor,
                                         ModelPruning, StochasticWeightAveraging)
from lightning.pytorch.utilities.model_helpers import is_overridden

# Trainer(precision=...) -> cfx's policy (cfx.amp): fp32 master params, the compute dtype cast by the program
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}

# LightningModule hooks that see torch.nn parameters, gradients or a torch optimizer
GRADIENT_HOOKS = ("backward", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                  "configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad", "on_before_zero_grad",
                  "lr_scheduler_step", "configure_model", "configure_sharded_model")
CALLBACK_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
PARAMETER_CALLBACKS = (StochasticWeightAveraging, BaseFinetuning, ModelPruning)
HOOK_FIX = ("compute it from the params in the optimizer transform (a cfx.optim GradientTransformation "
            "sees the grads and params), or read module.params() in on_train_batch_end")


def policy_of(precision: str) -> str:
    """cfx's precision for Lightning's flag; ValueError for a flag without one."""
    if str(precision) not in PRECISIONS:
        raise ValueError(f"cfx.lightning.Strategy: Trainer(precision={precision!r}) has no cfx policy; use "
                         "'32-true', 'bf16-mixed' or '16-mixed' (cfx keeps fp32 master params and casts for compute).")
    return PRECISIONS[str(precision)]


def check_fit(trainer: "pl.Trainer", module: "pl.LightningModule", base: type) -> None:
    """ValueError, naming the alternative, for the first feature the Plan's program cannot honour
    (module doc); ``base`` is ``cfx.lightning.Module``."""
    name = type(module).__name__
    if not isinstance(module, base):
        raise ValueError(f"cfx.lightning.Strategy trains a cfx.lightning.Module (a cfx model and an optimizer "
                         f"transform), not {name}; use Lightning's own strategies for torch.nn modules.")
    held = [n for n, _ in module.named_parameters()]
    if held:
        raise ValueError(f"{name} holds torch.nn parameters ({held[0]!r}), which the Plan's program would not train; "
                         "put them in the cfx model's params.")
    if not module.automatic_optimization:
        raise ValueError(f"{name}: manual optimisation is not supported; the Plan's program runs forward, backward "
                         "and update in one step: keep automatic_optimization and write the update as a cfx.optim "
                         "transform.")
    if is_overridden("configure_optimizers", module, base):
        raise ValueError(f"{name}.configure_optimizers: the optimizer is the one cfx transform given to Module(model, "
                         "tx); combine several with cfx.optim.chain (or a mask) instead of a second optimizer.")
    for hook in GRADIENT_HOOKS:
        if is_overridden(hook, module, pl.LightningModule):
            raise ValueError(f"{name}.{hook} reaches into torch.nn parameters or a torch optimizer, which a cfx Module "
                             f"does not have; {HOOK_FIX}.")
    _check_callbacks(trainer.callbacks)
    if trainer.gradient_clip_val:
        raise ValueError(f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): clip in the optimizer transform "
                         "instead, cfx.optim.chain(cfx.optim.clip_by_global_norm(v), tx) (TrainConfig.grad_clip).")


def _check_callbacks(callbacks: list) -> None:
    for cb in callbacks:
        name = type(cb).__name__
        if isinstance(cb, GradientAccumulationScheduler):
            raise ValueError(f"{name}: the Plan's optimizer accumulates a fixed number of batches; use "
                             "Trainer(accumulate_grad_batches=N).")
        if isinstance(cb, LearningRateMonitor):
            raise ValueError(f"{name}: the Module logs 'lr' itself, the schedule it was given (Module(model, tx, "
                             "lr=schedule); from_config gives it); a torch optimizer's lr would read 0.")
        hook = next((h for h in CALLBACK_HOOKS if is_overridden(h, cb, pl.Callback)), None)
        if isinstance(cb, PARAMETER_CALLBACKS) or hook is not None:
            raise ValueError(f"callback {name}{'.' + hook if hook else ''} acts on torch.nn parameters, which a cfx "
                             f"Module does not have; {HOOK_FIX}.")
