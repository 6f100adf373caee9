"""``Module``: a cfx model and its optimizer transform as a LightningModule.

The module holds no ``torch.nn`` parameters: its params are the model's pytree, which the
``Strategy``'s program (the Plan's) builds, steps and saves. ``training_step`` runs one step of that
program -- forward, backward and the update -- on the batch and logs the loss and learning rate;
``validation_step`` / ``test_step`` log the loss without dropout. Override them to log more,
calling ``self.step(batch)`` / ``self.evaluate(batch)`` for the numbers.

The keys are the training job's (``train.data.run_keys``): ``init`` for the params, ``fold_in(dropout, i)``
for step ``i``'s dropout, so ``Module.from_config(cfg)`` with ``ByteData.from_config(cfg)`` trains
what ``python -m cfx.train`` trains with ``cfg``, step for step.
"""
from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch

from cfx._src.train.data import run_keys
from cfx._src.train.config import TrainConfig
from cfx._src.train.model import build_model, build_optimizer, build_schedule


class PlanOptimizer(torch.optim.Optimizer):
    """The optimizer as Lightning sees it: the Plan's program updates the params itself (with the
    Module's ``tx``), so stepping this one only runs Lightning's closure, the training step."""

    def __init__(self):
        super().__init__([torch.zeros(0)], {"lr": 0.0})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return closure() if closure is not None else None


class Module(pl.LightningModule):
    """``model`` (a cfx model: ``init`` / ``loss`` / ``axes``) trained by ``tx`` (a cfx.optim
    transformation) under ``Trainer(strategy=cfx.lightning.Strategy(plan))``; ``seed`` gives the
    keys (module doc); ``lr`` (a number or a schedule of the optimizer step) is what ``"lr"`` logs;
    ``config``, the ``TrainConfig`` it was built from, goes into checkpoints' metadata."""

    def __init__(self, model: Any, tx: Any, *, seed: int = 0, lr: float | Callable | None = None,
                 config: TrainConfig | None = None):
        super().__init__()
        if not (callable(getattr(model, "init", None)) and callable(getattr(model, "loss", None))):
            raise ValueError(f"cfx.lightning.Module: model is a {type(model).__name__}, not a cfx model with init and "
                             "loss; pass e.g. cfx.models.gpt2('tiny').")
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"cfx.lightning.Module: tx is a {type(tx).__name__}, not a cfx.optim "
                             "GradientTransformation; pass e.g. cfx.optim.adamw(3e-4).")
        keys = run_keys(seed)
        self.model, self.tx, self.lr, self.config = model, tx, lr, config
        self.init_key, self.dropout_key = keys.init, keys.dropout
        self.trained_params: Any = None  # the model's params after a fit (global tensors)
        self._runner: Any = None         # the Strategy running this module's program, while it does

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "Module":
        """The model, optimizer (its schedule and clip included) and keys of ``python -m cfx.train``
        run with ``cfg``; the plan is the Strategy's, the precision the Trainer's."""
        model = build_model(cfg)
        return cls(model, build_optimizer(cfg, model), seed=cfg.seed, lr=build_schedule(cfg), config=cfg)

    # -- what the strategy's program does -----------------------------------------------------
    def step(self, batch: Any) -> float:
        """One training step of the Plan's program on ``batch`` (``(tokens, targets)``); its loss."""
        return self._running().run_step(batch)

    def evaluate(self, batch: Any) -> float:
        """The model's loss on ``batch`` without dropout, under the plan."""
        return self._running().evaluate(batch)

    def params(self) -> Any:
        """The model's params as global tensors: during a fit (on a mesh of processes every one
        calls it), or the finished fit's."""
        if self._runner is not None:
            return self._runner.params()
        if self.trained_params is None:
            raise ValueError("cfx.lightning.Module.params: nothing trained yet; call trainer.fit(module) first.")
        return self.trained_params

    def lr_at(self, step: int) -> float | None:
        """The learning rate of optimizer step ``step`` (None without ``lr``)."""
        return None if self.lr is None else float(self.lr(step) if callable(self.lr) else self.lr)

    def _running(self) -> Any:
        if self._runner is None:
            raise ValueError("cfx.lightning.Module runs under its strategy: Trainer(strategy=cfx.lightning.Strategy("
                             "'data=2 zero=3'), ...) (or Strategy() for one device).")
        return self._runner

    # -- Lightning's hooks ----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        lr = self.lr_at(self.trainer.global_step)  # the step the optimizer takes next
        loss = self.step(batch)
        self.log("train_loss", loss, prog_bar=True)
        if lr is not None:
            self.log("lr", lr)
        return torch.tensor(loss)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.evaluate(batch), prog_bar=True, sync_dist=True)  # equal on every process

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.evaluate(batch), sync_dist=True)

    def configure_optimizers(self) -> PlanOptimizer:
        return PlanOptimizer()
