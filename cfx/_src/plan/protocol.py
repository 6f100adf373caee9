"""What a training loop may ask of a program: the ``TrainProgram`` protocol and its ``TrainState``.

Every way cfx trains -- a Plan on a mesh (``program.Program``), one device without a mesh
(``local.LocalProgram``), ``cfx.autoshard``'s searched step (``AutoProgram``) -- is a
``TrainProgram``; the training job, Lightning and the checkpoint code depend on this protocol and
on nothing else of each other.

    program = plan.step(model, tx, mesh=mesh)    # mesh=None: one device
    state = program.init(key)                    # TrainState(params, opt_state, frozen)
    state, metrics = program(state, batch, key)  # the pure step; ``state`` is donated
    program.loss(state, *batch), program.params(state)

``TrainState.frozen`` holds weights the step reads and never trains (a LoRA base, a frozen
encoder: ``models.frozen``), laid out as the plan lays out the params -- ZeRO-3's pieces over
``data``, held by the pipe stage that runs them, in host memory or files under offload
(``plan/frozen.py``) -- but without gradients or optimizer state; None where the model has none.
They are the same placed trees the model's layers gather from as they run (the program built the
model over them), so the step passes them through untouched; checkpoints hold the trained state
alone (the frozen weights come from where the base came from).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch


class TrainState(NamedTuple):
    """A program's state between steps (module doc); its leaves are ShardedArrays on a mesh,
    plain tensors on one device."""

    params: Any            # what the optimizer trains, in the program's stored layout
    opt_state: Any         # the optimizer's state over ``params``
    frozen: Any = None     # weights read but never trained; None: none


@runtime_checkable
class TrainProgram(Protocol):
    """A train step with its state's constructors and readers (module doc)."""

    plan: Any
    model: Any

    @property
    def remat_plan(self) -> Any:
        """The activation-checkpointing schedule the last step ran (``remat=auto``), else None."""

    def init(self, key: torch.Tensor) -> TrainState:
        """A fresh state: the model's params from ``key`` and the optimizer's state on them."""

    def init_from(self, params: Any) -> TrainState:
        """A state starting from ``params``, the model's tree of global tensors (pretrained weights)."""

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A state from global trees (a checkpoint's params and optimizer state)."""

    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None
                 ) -> tuple[TrainState, dict]:
        """``(state, batch, key) -> (state, {"loss": ...})``; ``key`` drives dropout (None: none)."""

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        """The model's loss on a global batch, without dropout."""

    def params(self, state: TrainState) -> Any:
        """The model's params as global tensors."""

    def save(self, directory: str, state: TrainState, *, metadata: dict | None = None) -> Any:
        """``state`` in model coordinates as a checkpoint directory (every process calls it)."""

    def load(self, directory: str, like: TrainState) -> tuple[TrainState, dict]:
        """``(state, metadata)`` from a checkpoint any program of this model and optimizer saved."""

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """Text sampled from the model (a byte-level language model)."""
