"""A model whose chain of blocks runs under one checkpointing schedule, without the model knowing.

``Chained(model, schedule)`` has ``model``'s params, ``init``, ``axes`` and blocks; its ``apply`` /
``loss`` (and any other method of ``model``) run ``model``'s with ``schedule`` installed as the
runner of its chain of blocks (``chain_runner``): the model's block loop asks ``take_chain_runner()``
and, finding one, hands it the whole chain (``schedule.run(fns, params, x, kwargs)``). The runner is
taken by the first chain that asks, so layers nested inside the blocks run their own way. What
``cfx.remat.solve`` returns for a model, and what a Plan's ``remat=auto`` runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator

from cfx._src.core import context

_runner: context.Var[Any] = context.Var("cfx_remat_chain_runner", None,
                                        semantic="a remat schedule runs the chain of blocks")


@contextlib.contextmanager
def chain_runner(runner: Any) -> Iterator[None]:
    """Inside, the next chain of blocks a model runs goes through ``runner.run`` (None: one by one)."""
    token = _runner.set(runner)
    try:
        yield
    finally:
        _runner.reset(token)


def take_chain_runner() -> Any:
    """The runner installed for the chain the caller is about to run, or None. The caller runs the
    chain inside ``chain_runner(None)``, so the blocks' own sublayers run theirs one by one."""
    return _runner.get()


@dataclasses.dataclass(frozen=True, eq=False)
class Chained:
    """``model`` with its blocks run as one chain under ``schedule`` (module doc)."""

    model: Any
    schedule: Any

    @property
    def blocks(self) -> tuple:
        return self.model.blocks

    def init(self, key: Any) -> Any:
        return self.model.init(key)

    def axes(self) -> Any:
        return self.model.axes()

    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        with chain_runner(self.schedule):
            return self.model.apply(params, *args, **kwargs)

    def loss(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        with chain_runner(self.schedule):
            return self.model.loss(params, *args, **kwargs)

    def map_blocks(self, f: Callable[[Any], Any]) -> "Chained":
        return Chained(self.model.map_blocks(f), self.schedule)

    def with_layers(self, **layers: Any) -> "Chained":
        return Chained(self.model.with_layers(**layers), self.schedule)

    def __getattr__(self, name: str) -> Any:  # config, sublayers, hidden, ... of the model, under the schedule
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.model, name)
        if not callable(attr) or isinstance(attr, type) or name in ("parts",):
            return attr

        @functools.wraps(attr)
        def scheduled(*args: Any, **kwargs: Any) -> Any:
            with chain_runner(self.schedule):
                return attr(*args, **kwargs)
        return scheduled
