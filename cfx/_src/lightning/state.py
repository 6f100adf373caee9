"""The program a ``Strategy`` runs and its state: built, started, saved into a checkpoint and read back.

The program is the training job's choice (``train.local.program_for``): one device's
``LocalProgram`` for a plan without a mesh, the plan's own ``Program`` otherwise. Both save the
same thing, their state in model coordinates (``params`` and the optimizer's ``opt_state`` over
them), as one of cfx's sharded checkpoint directories -- a Plan's program every process its own
regions (``Program.save``), one device its whole tensors -- so either reads the other's, and
``python -m cfx.train --resume DIR`` reads both.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from cfx._src.checkpoint import file as checkpoint_file, sharded as checkpoint_sharded
from cfx._src.plan.program import Program


def start(program: Any, key: torch.Tensor, params: Any = None) -> Any:
    """The state at step 0: ``init(key)``, or ``params`` (the model's tree, e.g. a finished fit's)
    with the optimizer's state initialised on them."""
    if params is None:
        return program.init(key)
    if isinstance(program, Program):
        return program.init_from(params)
    return program.put(params, program.tx.init(params))


def save(program: Any, directory: str | os.PathLike, state: Any, metadata: dict) -> None:
    """``state`` into the checkpoint directory ``directory`` (every process calls it; module doc)."""
    if isinstance(program, Program):
        program.save(os.fspath(directory), state, metadata=metadata)
    else:
        checkpoint_sharded.save(directory, {"params": state.params, "opt_state": state.opt_state}, metadata=metadata)


def load(program: Any, directory: str | os.PathLike, state: Any) -> tuple[Any, dict]:
    """``(state, metadata)`` read from a checkpoint any program wrote into ``state`` (this program's)."""
    if isinstance(program, Program):
        return program.load(os.fspath(directory), state)
    tree, meta = checkpoint_file.load(directory, {"params": state.params, "opt_state": state.opt_state})
    return program.put(tree["params"], tree["opt_state"]), meta
