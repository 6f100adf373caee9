"""Donated tensors, deleted: what ``cfx.jit(..., donate_argnums=...)`` leaves in the caller's hands.

The caller's tensor objects gave their buffers to the call's outputs. Each is emptied (it no
longer shares the buffer it gave away) and turned into a ``DonatedTensor``, whose every use
raises a ``ValueError`` that names the function, the argument and the leaf -- JAX's "Array has
been deleted", instead of silently reading the new values through an old name.
"""
from __future__ import annotations

from typing import Any

import torch


class DonatedTensor(torch.Tensor):
    """A tensor whose buffer was donated to a ``cfx.jit`` call; every use raises."""

    _cfx_donated: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for x in (*args, *(kwargs or {}).values()):
            if isinstance(x, DonatedTensor):
                raise ValueError(x._cfx_donated)
            if isinstance(x, (list, tuple)):
                for y in x:
                    if isinstance(y, DonatedTensor):
                        raise ValueError(y._cfx_donated)
        raise ValueError("cfx.jit: a donated tensor was used after its call.")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"<DonatedTensor: {self._cfx_donated}>"


def delete(t: torch.Tensor, why: str) -> None:
    """Empty ``t`` and make every later use of it raise ``ValueError(why)``."""
    with torch.no_grad():
        t.set_()
    t.__class__ = DonatedTensor
    t._cfx_donated = why


def is_deleted(x: Any) -> bool:
    return isinstance(x, DonatedTensor)
