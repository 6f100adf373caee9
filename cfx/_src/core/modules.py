"""Public modules that are also functions: ``cfx.zero(tx, stage=2)`` calls the transform while
``cfx.zero.gathered`` is a name the module ``cfx/zero.py`` lists in its ``__all__`` -- so every
public name has a module home that docs, type checkers and ``from cfx.zero import gathered`` see,
and the short spelling JAX users know (``jax.checkpoint``-style callables) keeps working."""
from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__call_target__(*args, **kwargs)


def callable_module(name: str, fn: Callable[..., Any]) -> None:
    """Make the module ``name`` (already in ``sys.modules``: call this at its end) callable as
    ``fn``; ``inspect.signature(module)`` is ``fn``'s."""
    module = sys.modules[name]
    module.__call_target__ = fn
    module.__signature__ = inspect.signature(fn)
    module.__class__ = _CallableModule
