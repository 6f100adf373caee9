"""The Plan's contract: each part of a training strategy is one ``Strategy`` object.

A Plan names its strategy as data (``config.PlanConfig``); the parts that act on it -- pipeline
stages, expert, sequence and tensor parallelism, the tensor grid, data parallelism with ZeRO,
activation checkpointing, offload -- are each one ``Strategy`` in ``cfx/_src/plan/strategies/``,
listed once, in the order they apply, in ``strategies.STRATEGIES``. A ``Program`` knows no strategy
by name: it asks every strategy the same questions, in that order, phase by phase (a strategy the
plan does not use answers each as a no-op):

1. **checks** -- ``check_plan`` (the plan's own fields, no model), ``check`` (against a model; the
   compatibility matrix lives here, with the strategy it concerns), ``jit_refusal``;
2. **layout** -- ``axes`` (the mesh axes it owns: ``Plan.parse`` accepts exactly the strategies'),
   ``rules`` (logical axes of the params -> mesh axes, for ``Layout``) or ``param_specs`` (its own),
   ``place_state`` (where the state's blocks live), ``place_frozen`` (where a model's frozen weights
   live: ``TrainState.frozen``, laid out as the params are);
3. **the model each rank runs** -- ``parallelize`` (its parallel form: attention over a split sequence,
   Megatron's split blocks, ...), ``wrap_block`` (each block, the first strategy innermost: ZeRO-3's
   gathering inside remat's recomputation), ``wrap_chain`` (how the blocks run as one chain: a remat
   schedule), ``wrap_root`` (around the whole model: ZeRO-3's gathering of what is left);
4. **the step** -- ``arrange`` (a global batch's order), ``solve`` (a schedule for a batch shape:
   ``remat=auto``), ``runner`` (how a rank computes its loss and gradients: the pipeline's schedule,
   offload's placement around it), ``reduce`` (the gradients' reductions after backward, in list
   order), ``wrap_optimizer`` (the optimizer the step runs over the stored layout: ZeRO's);
5. **accounting** -- ``account``: per-rank bytes by kind and the tier each lives on, computed on
   shapes; ``Plan.describe`` prints it and a cluster estimate reads it, so they are the step's figures.

Every hook defaults to doing nothing, so a strategy defines only what it changes. A new axis is one
module in ``strategies/`` and one entry in ``STRATEGIES`` (docs/ARCHITECTURE.md works an example).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from typing import Protocol

import torch

from cfx._src.zero.params import ZeroParams


class Runner(Protocol):
    """How a rank computes its loss: ``grads`` in the step, ``loss`` for evaluation."""

    def grads(self, local: Any, batch: tuple, key: Any, scale: Any, view: Callable[[Any], Any]
              ) -> tuple[torch.Tensor, Any]:
        """``(loss, grads)`` of ``local`` -- what the rank stores, as the model's tree (a ``ZeroParams``
        under ZeRO-3) -- on its share of ``batch``; ``view(local)`` is what the model runs on (cast to
        the compute dtype; offload's chunk copies), ``scale`` the fp16 loss scale (None: none)."""

    def loss(self, local: Any, batch: tuple) -> torch.Tensor:
        """The loss of ``local`` (cast already) on its share of ``batch``, without gradients."""


def on_pieces(grads: Any, f: Callable[[Any], Any]) -> Any:
    """``f`` of the gradients' tree: a ``ZeroParams``' pieces (ZeRO-3), else the tree itself."""
    if isinstance(grads, ZeroParams):
        return ZeroParams(f(grads.pieces), grads.shapes, grads.n)
    return f(grads)


@dataclasses.dataclass
class Built:
    """What a program has built, for the strategies' ``runner`` / ``reduce`` / ``wrap_optimizer``
    hooks: the plan, the model as given, the model each rank runs (``local``; ``None`` until it is
    built), the stored ``Layout``, the mesh, the optimizer the step runs, the remat schedule (``None``
    unless ``remat=auto`` solved one) and, with ``offload=nvme``, its directory."""

    plan: Any
    model: Any
    layout: Any
    mesh: Any
    local: Any = None
    opt: Any = None
    schedule: Any = None
    nvme_dir: str | None = None
    shared: dict = dataclasses.field(default_factory=dict)  # kept by a program across its builds (per schedule)


@dataclasses.dataclass
class Account:
    """Per-rank bytes by kind (``bytes``) and the tier each kind lives on (``tiers``: device, host
    or nvme), filled in by the strategies' ``account`` hooks in list order."""

    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    tiers: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, nbytes: int, tier: str = "device") -> None:
        self.bytes[kind] = int(nbytes)
        self.tiers[kind] = tier


class Strategy:
    """One part of a training strategy (module doc). Subclasses set ``name`` and ``axes`` and
    override the hooks they need; each hook receives the plan first."""

    name: str = ""
    axes: tuple[str, ...] = ()  # the mesh axes this strategy owns

    def prepare(self, plan, built: "Built") -> None:
        """Before anything is laid out: set up what the program will need (offload=nvme's directory)."""

    # -- 1. checks ---------------------------------------------------------------------------------------
    def check_plan(self, plan) -> None:
        """ValueError if the plan's own fields do not fit this strategy (no model needed)."""

    def check(self, plan, model, where: str) -> None:
        """ValueError naming what of ``model`` does not fit this strategy, and the fix."""

    def jit_refusal(self, plan) -> str | None:
        """Why ``jit=`` cannot compile a step under this strategy, or None."""
        return None

    # -- 2. layout -----------------------------------------------------------------------------------------
    def rules(self, plan) -> dict[str, Any]:
        """Logical axes of the params mapped to this strategy's mesh axes (``cfx.parallel.Rules``)."""
        return {}

    def param_specs(self, plan, model, mesh) -> Any:
        """The params' specs where this strategy lays them out other than by logical axes, else None."""
        return None

    def place_state(self, plan, state: Any, built: "Built") -> Any:
        """The train state moved where this strategy keeps it (offload's files)."""
        return state

    def place_frozen(self, plan, placer: Any, model: Any) -> Any:
        """The ``plan.frozen.Placer`` for ``model``'s frozen weights with what this strategy changes of
        where they live (ZeRO-3's axis, the pipe stages, offload's home), as it keeps the params."""
        return placer

    # -- 3. the model each rank runs -----------------------------------------------------------------
    def parallelize(self, plan, model) -> Any:
        return model

    def wrap_block(self, plan, block) -> Any:
        return block

    def wrap_chain(self, plan, model, schedule) -> Any:
        return model

    def wrap_root(self, plan, model) -> Any:
        return model

    # -- 4. the step -------------------------------------------------------------------------------------
    def arrange(self, plan, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A global token batch in the order this strategy splits it (the ring's zigzag positions)."""
        return tokens, targets

    def solve(self, plan, built: "Built", tokens: torch.Tensor, key: Any) -> Any:
        """A schedule solved for a batch like ``tokens`` (``remat=auto``'s), else None."""
        return None

    def runner(self, plan, inner: Runner, built: Built) -> Runner:
        return inner

    def reduce(self, plan, grads, built: Built) -> Any:
        return grads

    def wrap_optimizer(self, plan, tx, built: Built) -> tuple[Any, Any] | None:
        """``(the optimizer the step runs, its state's specs)``, or None to leave ``tx`` as it is."""
        return None

    def sampling_form(self, plan, model) -> Any:
        """The model as every rank decodes it with its own share of the params (the step's stored
        layout, a pipe stage's and ZeRO-3's pieces gathered), or None where this strategy's form keeps
        no KV cache: then every rank samples the whole model."""
        return model

    # -- 5. accounting -------------------------------------------------------------------------------------
    def account(self, plan, acc: Account, built: Built) -> None:
        """Add this strategy's per-rank bytes by kind (and tiers) to ``acc``, on shapes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
