"""``cfx.parallel.Plan``: one frozen object naming the whole training strategy.

    plan = cfx.parallel.Plan.parse("pipe=2,data=2,model=2 zero=1 remat=blocks microbatches=2")
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)      # a Program: the pure, donated train step
        state = step.init(key)                      # TrainState(params, opt_state) of ShardedArrays
        for tokens, targets in batches:
            state, metrics = step(state, (tokens, targets))
        params = step.params(state)                 # the model's tree, global tensors

The fields and their text are ``config.PlanConfig``; how params are stored, ``layout``; the
step, ``program``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cfx._src.mesh.mesh import Mesh
from cfx._src.models.function import as_model
from cfx._src.plan.config import PlanConfig
from cfx._src.plan.describe import Description, describe
from cfx._src.plan.build import check_model
from cfx._src.plan.local import LocalProgram
from cfx._src.plan.program import Program
from cfx._src.plan.protocol import TrainProgram, TrainState


@dataclasses.dataclass(frozen=True)
class Plan(PlanConfig):
    """A training strategy over the mesh axes ``pipe``, ``data``, ``seq``, ``model`` (see the
    module doc; the fields are documented on ``PlanConfig``)."""

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """``Plan.parse("pipe=2,data=2 zero=1 remat=blocks")``; ``Plan.parse(str(p)) == p``."""
        return cls(**cls.parse_fields(text))

    def make_mesh(self, *, backend: str = "auto", **kwargs: Any) -> Mesh:
        """The plan's mesh (local threads, or one process per rank under torchrun)."""
        if not self.mesh:
            raise ValueError("Plan: a single-device plan has no mesh; give it an axis, e.g. data=1.")
        return Mesh(self.mesh_shape, backend=backend, **kwargs)

    def check(self, model: Any, **function: Any) -> None:
        """ValueError, naming the parts that do not fit and the fix, unless this plan can train
        ``model`` (heads and vocabulary divisible by ``model``, blocks by ``pipe`` x ``chunks``,
        the parts protocol under a pipe axis, ...). Needs no mesh. ``model`` may be a loss
        function with ``params=`` or ``init=`` (and ``specs=``), as for ``step``."""
        check_model(self, as_model(model, **function))

    def describe(self, model: Any, tx: Any = None, *, batch: tuple[int, int] | None = None,
                 **function: Any) -> Description:
        """Per-rank bytes by kind and tier -- params, grads, optimizer state (``tx``, default
        AdamW), one gathered ZeRO-3 block, offload's device chunks and, given ``batch=(rows, seq)``,
        activations -- and the collectives per axis and phase, computed on shapes before anything
        runs (``print`` it). ``model`` may be a loss function with ``params=`` / ``init=``."""
        return describe(self, as_model(model, **function), tx, batch=batch)

    def step(self, model: Any, tx: Any, *, mesh: Mesh | None = None, params: Any = None, init: Any = None,
             specs: Any = None, grad_clip: float = 0.0, nvme_dir: str | None = None,
             jit: bool | str = False) -> TrainProgram:
        """The train step ``step(state, batch) -> (state, metrics)``, a ``TrainProgram``
        (``cfx._src.plan.protocol``: also ``init``, ``params``, ``put``, ``loss``, ``save``, ``load``
        and ``sample``): a ``Program`` on ``mesh``, or without a mesh the single-device plan's
        ``LocalProgram``; every check runs here, before any rank starts. ``model`` is a cfx model, or your own pure ``loss_fn(params, *batch)`` (a
        mean over the batch rows) with its starting ``params`` or an ``init(key)``, and optionally
        ``specs`` laying the params over the mesh (``cfx._src.models.function``).
        ``grad_clip > 0`` clips by the global norm over every shard; ``nvme_dir``: where
        ``offload=nvme`` keeps the state's files (default: a new temporary directory); ``jit``:
        compile each rank's step with ``cfx.jit`` (True: inductor, or a ``torch.compile`` backend
        name), the state donated to it."""
        model = as_model(model, params=params, init=init, specs=specs)
        if mesh is None:
            if jit:
                raise ValueError("jit=True compiles a Plan's step on a mesh; give the plan an axis (e.g. 'data=1') "
                                 "and its mesh, or drop jit.")
            return LocalProgram(self, model, tx, grad_clip=grad_clip)
        return Program(self, model, tx, mesh, grad_clip=grad_clip, nvme_dir=nvme_dir, jit=jit)

    def init(self, model: Any, tx: Any, key, *, mesh: Mesh | None = None, **function: Any) -> TrainState:
        """Sharded params and optimizer state; ``plan.step(model, tx, mesh=mesh).init(key)``."""
        return self.step(model, tx, mesh=mesh, **function).init(key)
