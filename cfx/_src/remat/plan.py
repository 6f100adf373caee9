"""``cfx.remat.solve``: checkpoint a chain of blocks optimally for a memory budget.

    model_r, plan = cfx.remat.solve(model, params, tokens, budget=512 * 2**20)
    print(plan)                                    # what is kept, what is recomputed, the cost
    loss = model_r.loss(params, tokens, targets)   # same values and gradients, less memory

The chain is profiled from a fake-tensor trace (``profile.py``: FLOPs and activation bytes, no
real compute), the schedule comes from Rotor's dynamic program (``solver.py``), and the returned
model runs its blocks as one chain under that schedule (``execute.py``). ``chen`` gives Chen et
al.'s sqrt(n) segmentation on the same machinery, as a baseline. ``f`` may also be a plain list
of stage functions ``fn(params_i, x, **kwargs_i) -> x``; then ``args`` are ``(params_list, x)``
and the runnable is ``fn(params_list, x, kwargs_list=None)``.

The budget covers the chain's activations: its input, what each block keeps for backward and the
gradients flowing between blocks (the memory model in ``solver.py``); parameters, their gradients
and the head's logits are not part of it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from cfx._src.remat import solver
from cfx._src.remat.chain import Chain
from cfx._src.remat.chained import Chained
from cfx._src.remat.execute import run_chain
from cfx._src.remat.profile import StageProfile, profile_chain
from cfx._src.core.text import format_bytes, format_table, parse_bytes


@dataclasses.dataclass(frozen=True)
class RematSolution:
    """A checkpointing schedule for a profiled chain, runnable with :meth:`run`."""

    schedule: solver.Schedule
    profiles: tuple[StageProfile, ...]
    method: str
    budget: int | None = None

    @property
    def chain(self) -> Chain:
        return self.schedule.chain

    @property
    def peak(self) -> int:
        """Peak activation bytes under the memory model (the solver keeps it <= budget)."""
        return self.schedule.peak

    @property
    def recompute_flops(self) -> float:
        c = self.chain
        return self.schedule.time - sum(c.fw) - sum(c.bw)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs over the FLOPs of a plain forward + backward."""
        c = self.chain
        return self.recompute_flops / (sum(c.fw) + sum(c.bw))

    def run(self, fns: Sequence[Callable], params: Sequence[Any], x: torch.Tensor,
            kwargs: Sequence[dict] | None = None) -> torch.Tensor:
        kwargs = kwargs if kwargs is not None else [{}] * len(fns)
        return run_chain(fns, params, x, kwargs, self.schedule)

    def summary(self) -> list[tuple]:
        """Rows (what, value) describing the plan."""
        no = solver.no_remat(self.chain)
        rows = [("method", self.method), ("stages", self.chain.n)]
        if self.budget is not None:
            rows.append(("budget", format_bytes(self.budget)))
        rows += [("peak activations", format_bytes(self.peak)),
                 ("no-remat peak", format_bytes(no.peak)),
                 ("forward + backward", f"{(sum(self.chain.fw) + sum(self.chain.bw)) / 1e9:.3f} GFLOP"),
                 ("recomputed", f"{self.recompute_flops / 1e9:.3f} GFLOP "
                                f"(+{100 * self.recompute_fraction:.1f}%)")]
        return rows

    def __str__(self) -> str:
        kept = [op.stage for op in self.schedule.ops if op.kind == solver.F_ALL]
        lines = [format_table(self.summary(), ["plan", "value"]), "",
                 f"stage runs with grad: {kept}", str(self.schedule)]
        return "\n".join(lines)


class _Captured(Exception):
    def __init__(self, x, mask, keys):
        super().__init__("block inputs captured")
        self.x, self.mask, self.keys = x, mask, keys


@dataclasses.dataclass(frozen=True)
class _Probe:
    """Stands in for a plan to capture the blocks' input, mask and keys, then stops the forward."""

    def run(self, fns, params, x, kwargs):
        raise _Captured(x, kwargs[0]["mask"] if kwargs else None, [k["key"] for k in kwargs])


def _is_model(f: Any) -> bool:
    return hasattr(f, "blocks") and callable(getattr(f, "map_blocks", None)) and hasattr(f, "apply")


def _chain_of(f: Any, args: tuple, mask, key):
    """(fns, stage params, chain input, stage kwargs, names) for a model or a list of stages."""
    if _is_model(f):
        if len(args) != 2:
            raise ValueError("remat.solve(model, params, tokens, budget=...): pass the model's params "
                             f"and an example batch of tokens; got {len(args)} positional arguments.")
        params, tokens = args
        if not isinstance(params, dict) or not params.get("blocks"):
            raise ValueError("remat.solve: params must be the model's params dict with a 'blocks' list.")
        try:
            with torch.no_grad():
                Chained(f, _Probe()).apply(params, tokens, mask=mask, key=key)
        except _Captured as c:
            x, mask_, keys = c.x, c.mask, c.keys
        else:
            raise ValueError(f"remat.solve: {type(f).__name__}.apply does not run its blocks as a chain a schedule "
                             "can take (cfx.remat.Chained: its block loop asks take_chain_runner()); pass the "
                             "blocks as a list of stage functions instead.")
        fns = [b.apply for b in f.blocks]
        kwargs = [dict(mask=mask_, key=k) for k in keys]
        names = [f"blocks.{i}" for i in range(len(fns))]
        return fns, list(params["blocks"]), x, kwargs, names
    if isinstance(f, (list, tuple)) and f and all(callable(s) for s in f):
        if len(args) != 2:
            raise ValueError("remat.solve(stages, params_list, x, budget=...): pass one params pytree "
                             "per stage and the chain input.")
        params, x = args
        if len(params) != len(f):
            raise ValueError(f"remat.solve: {len(f)} stages but {len(params)} params entries; pass one "
                             "params pytree per stage (an empty dict for a stage without params).")
        return list(f), list(params), x, [{}] * len(f), [f"stage {i + 1}" for i in range(len(f))]
    raise ValueError("remat.solve: f must be a cfx model with blocks (GPT-2, Llama) or a list of stage "
                     f"functions fn(params, x) -> x; got {type(f).__name__}.")


def _finish(f: Any, plan: RematSolution):
    if _is_model(f):
        return Chained(f, plan), plan

    def run(params, x, kwargs=None):
        return plan.run(f, params, x, kwargs)
    return run, plan


def _profile(f, args, mask, key):
    fns, params, x, kwargs, names = _chain_of(f, args, mask, key)
    chain, profiles = profile_chain(fns, params, x, kwargs, names=names)
    return chain, tuple(profiles)


def solve(f: Any, *args: Any, budget: int | str, mask: torch.Tensor | None = None,
          key: torch.Tensor | None = None, max_slots: int = 20000):
    """The fastest schedule (Rotor) whose peak activation memory fits ``budget`` bytes.

    Returns ``(runnable, plan)``: for a model, ``Chained(model, plan)``, which runs its blocks under the plan. Raises
    ValueError stating the minimum feasible budget when ``budget`` is below it.
    """
    budget = parse_bytes(budget)
    chain, profiles = _profile(f, args, mask, key)
    schedule = solver.solve(chain, budget, max_slots=max_slots)
    return _finish(f, RematSolution(schedule, profiles, "rotor", budget))


def chen(f: Any, *args: Any, segment: int | None = None, mask: torch.Tensor | None = None,
         key: torch.Tensor | None = None):
    """Chen et al.'s sqrt(n) checkpointing (``segment`` blocks per segment; 1 = every block's input
    kept, i.e. full-block checkpointing), as ``(runnable, plan)`` on the same executor."""
    chain, profiles = _profile(f, args, mask, key)
    schedule = solver.chen(chain, segment=segment)
    return _finish(f, RematSolution(schedule, profiles, schedule.name))


def minimum_budget(f: Any, *args: Any, mask: torch.Tensor | None = None,
                   key: torch.Tensor | None = None, max_slots: int = 20000) -> int:
    """The smallest budget :func:`solve` accepts for this chain (bytes)."""
    chain, _ = _profile(f, args, mask, key)
    return solver.minimum_budget(chain, max_slots=max_slots)
