"""``Strategy``: a ``cfx.parallel.Plan`` as a Lightning strategy.

    trainer = L.Trainer(strategy=cfx.lightning.Strategy("data=2 zero=3"), devices=2, precision="bf16-mixed")
    trainer.fit(cfx.lightning.Module(model, tx), data)

The plan's fields are the strategy's arguments (a Plan, its text, and keyword fields on top:
``Strategy("data=2", zero=3, remat="blocks")``); the precision is the Trainer's flag, mapped to
cfx's policy (``checks.PRECISIONS``). At ``setup`` the strategy builds the program the training
job would (``Plan.step``) and its state; each ``training_step`` of the ``Module`` runs one
step of it. Lightning's loop keeps its part -- logging, validation, callbacks, checkpoints, the
progress bar, accumulation (``cfx.optim.accumulate`` around the module's ``tx``) -- and the
strategy answers its calls: ``backward`` and ``optimizer_step`` only run Lightning's closure
(the program already did both), a checkpoint is a directory holding cfx's sharded checkpoint of
the state beside Lightning's own file of loops and callbacks (``LIGHTNING_FILE``).

Processes: ``devices=N`` with N equal to the plan's ranks runs one process per rank through
Lightning's launcher (or torchrun) on cfx's ``dist`` mesh over the process group Lightning starts;
``devices=1`` runs every rank as a thread of this one process (the ``local`` mesh, fine in a
notebook). Every process feeds the program the same global batch (Lightning's sampler is told
there is one replica), which the program splits over its ``data`` axis.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any, Callable

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from cfx._src.core import random as jr
from cfx._src.lightning import state as state_io
from cfx._src.lightning.checks import check_fit, policy_of
from cfx._src.lightning.module import Module
from cfx._src.mesh.mesh import DEFAULT_TIMEOUT_S
from cfx._src.optim.accumulate import accumulate
from cfx._src.plan.plan import Plan

LIGHTNING_FILE = "lightning.ckpt"  # in a checkpoint directory: the Trainer's loops, callbacks, logger state


class PolicyPrecision(Precision):
    """Lightning's precision flag, carried as is: the program casts by cfx's policy, so none of
    Lightning's autocasting or scaling runs (``policy_of`` maps the flag)."""

    def __init__(self, precision: str):
        self.precision = precision


class Strategy(DDPStrategy):
    """``plan`` (a Plan or its text) with ``fields`` set on top, as a Lightning strategy (module
    doc); ``nvme_dir`` and ``jit`` as for ``Plan.step``; ``timeout`` bounds every collective and
    the process group's start (seconds)."""

    def __init__(self, plan: Plan | str = "", *, nvme_dir: str | None = None, jit: bool | str = False,
                 timeout: float = DEFAULT_TIMEOUT_S, start_method: str = "popen", **fields: Any):
        plan = Plan.parse(plan) if isinstance(plan, str) else plan
        plan = dataclasses.replace(plan, **fields) if fields else plan
        if plan.precision != "fp32":
            raise ValueError(f"cfx.lightning.Strategy: the precision is the Trainer's flag; drop "
                             f"precision={plan.precision} from the plan and pass Trainer(precision='bf16-mixed' | '16-mixed').")
        super().__init__(timeout=datetime.timedelta(seconds=timeout), start_method=start_method)
        self.plan, self.nvme_dir, self.jit, self.timeout = plan, nvme_dir, jit, timeout
        self.steps = 0              # training steps the program has run (a checkpoint's "step")
        self._program: Any = None
        self._state: Any = None
        self._resume: str | None = None
        self._mesh = contextlib.ExitStack()

    # -- what Lightning asks of a strategy ------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else PolicyPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:
            policy_of(plugin.precision)  # a flag without a cfx policy is refused with the Trainer
            plugin = PolicyPrecision(plugin.precision)
        self._precision_plugin = plugin

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every process draws the global batch (module doc)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # cfx.optim.accumulate inside the program

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the program's state exists to be read into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the optimizer's state is the program's, restored with the params

    def _configure_launcher(self) -> None:
        processes = self.num_processes * self.num_nodes
        if processes > 1 and processes != self.plan.world_size:
            ranks = self.plan.world_size
            raise ValueError(f"cfx.lightning.Strategy: plan {str(self.plan) or 'one device'!r} has {ranks} rank(s) and "
                             f"the Trainer {processes} processes; use devices={ranks} (a process per rank) or devices=1 "
                             "(the ranks as threads of one process).")
        if processes > 1:
            super()._configure_launcher()
        else:
            self._launcher = None  # one process: nothing to launch (and a notebook can run it)

    def setup_distributed(self) -> None:
        if self.num_processes * self.num_nodes > 1:
            super().setup_distributed()
        else:
            self.set_world_ranks()  # one process: its ranks are threads (the local mesh), no process group

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_fit(trainer, module, Module)
        plan = dataclasses.replace(self.plan, precision=policy_of(self.precision_plugin.precision))
        if module.config is not None and module.config.precision != plan.precision:
            raise ValueError(f"Trainer(precision={self.precision_plugin.precision!r}) is cfx's {plan.precision}, and "
                             f"the module's TrainConfig has precision={module.config.precision!r}: make them agree.")
        k = trainer.accumulate_grad_batches
        tx = module.tx if k == 1 else accumulate(module.tx, k)
        mesh = self._mesh.enter_context(plan.make_mesh(backend="dist" if self.world_size > 1 else "local",
                                                       timeout=self.timeout)) if plan.mesh else None
        self._program = plan.step(module.model, tx, mesh=mesh, nvme_dir=self.nvme_dir, jit=self.jit)
        self._state = state_io.start(self._program, module.init_key, module.trained_params)
        self.steps = 0
        module._runner = self
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return closure_loss  # the program differentiated the loss in its step

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the training step: the program's step, update included

    def teardown(self) -> None:
        module = self.lightning_module
        if self._program is not None and module is not None:
            if module._trainer is not None and not module._trainer.interrupted:
                module.trained_params = self.params()  # (a collective on a mesh of processes)
            module._runner = None
        self._program = self._state = None
        self._mesh.close()
        super().teardown()

    # -- the program, for the Module ------------------------------------------------------------
    def run_step(self, batch: Any) -> float:
        """One step of the program on the global ``batch``; its loss (replicated)."""
        key = jr.fold_in(self.lightning_module.dropout_key, self.steps)
        self._state, metrics = self._program(self._state, tuple(batch), key)
        self.steps += 1
        return float(metrics["loss"])

    def evaluate(self, batch: Any) -> float:
        return self._program.loss(self._state, *batch)

    def params(self) -> Any:
        return self._program.params(self._state)

    # -- checkpoints: a directory of cfx's sharded checkpoint and Lightning's file ----------------
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        module = self.lightning_module
        meta = {"step": self.steps, **({"config": dataclasses.asdict(module.config)} if module.config else {})}
        state_io.save(self._program, filepath, self._state, meta)  # every process: its regions
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, os.path.join(filepath, LIGHTNING_FILE),
                                               storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path = os.fspath(checkpoint_path)
        if not os.path.isfile(os.path.join(path, LIGHTNING_FILE)):
            raise ValueError(f"ckpt_path {path!r} is not a checkpoint of cfx.lightning.Strategy (no {LIGHTNING_FILE} "
                             "in it); pass a directory that ModelCheckpoint or trainer.save_checkpoint wrote under it.")
        self._resume = path
        return self.checkpoint_io.load_checkpoint(os.path.join(path, LIGHTNING_FILE), weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._state, meta = state_io.load(self._program, self._resume, self._state)
        self.steps = int(meta.get("step", 0))
