"""What surrounds a compiled call of ``cfx.jit``: ``cfx.grad`` traced into the graph, and the
user's mistakes that the traced code raised as ``ValueError`` surfacing as ``ValueError`` (dynamo
wraps them in its own exceptions)."""
from __future__ import annotations

import ast
import contextlib
import re

import torch


@contextlib.contextmanager
def around_call(name: str):
    """Around a compiled call: ``cfx.grad`` traced into the graph (dynamo's config is per thread),
    and a ``ValueError`` the traced code raised (a check of the user's input) raised as one."""
    import torch._dynamo  # loaded when cfx.jit first compiles, not at import
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        try:
            yield
        except torch._dynamo.exc.InternalTorchDynamoError as e:  # raised by code dynamo ran for real
            cause = e.__cause__ or e.__context__
            if not isinstance(cause, ValueError):
                raise
            raise ValueError(f"cfx.jit({name}), while tracing: {cause}") from e
        except torch._dynamo.exc.Unsupported as e:  # raised by code dynamo traced
            message = _observed_value_error(e)
            if message is None:
                raise
            raise ValueError(f"cfx.jit({name}), while tracing: {message}") from e


def _observed_value_error(e: Exception) -> str | None:
    """The message of the ValueError dynamo saw the traced code raise, if that is what stopped it."""
    cause = e.__cause__
    text = str(cause.args[0]) if cause is not None and cause.args else ""
    prefix = "raised exception ValueError("
    if type(cause).__name__ != "ObservedValueErrorError":
        return None
    if not (text.startswith(prefix) and text.endswith(")")):  # torch 2.11: the message is in the context only
        said = re.search(r"raised exception ValueError\(\[ConstantVariable\(str: (\".*\"|'.*')\)\]\)", str(e))
        return _literal(said.group(1)) if said else None
    return _literal(text[len(prefix):-1])


def _literal(text: str) -> str:
    try:
        return str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return text
