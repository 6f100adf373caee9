"""The program a ``Strategy`` runs and its state: built, started, saved into a checkpoint and read back.

The program is the plan's (``Plan.step``: one device's ``LocalProgram`` for a plan without a mesh, a
``Program`` otherwise), and this module asks of it only the ``TrainProgram`` protocol
(``cfx._src.plan.protocol``). Every program saves the same thing, its state in model coordinates
(``params`` and the optimizer's ``opt_state`` over them), as one of cfx's checkpoint directories -- a
Plan's program every process its own regions, one device its whole tensors -- so either reads the
other's, and ``python -m cfx.train --resume DIR`` reads both.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from cfx._src.plan.protocol import TrainProgram


def start(program: TrainProgram, key: torch.Tensor, params: Any = None) -> Any:
    """The state at step 0: ``init(key)``, or ``params`` (the model's tree, e.g. a finished fit's)
    with the optimizer's state initialised on them."""
    return program.init(key) if params is None else program.init_from(params)


def save(program: TrainProgram, directory: str | os.PathLike, state: Any, metadata: dict) -> None:
    """``state`` into the checkpoint directory ``directory`` (every process calls it; module doc)."""
    program.save(os.fspath(directory), state, metadata=metadata)


def load(program: TrainProgram, directory: str | os.PathLike, state: Any) -> tuple[Any, dict]:
    """``(state, metadata)`` read from a checkpoint any program wrote into ``state`` (this program's)."""
    return program.load(os.fspath(directory), state)
