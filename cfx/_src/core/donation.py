"""Donated buffers: storages a caller has given up, so the code it calls may overwrite them.

JAX's donation, eager: ``shard_map(..., donate_argnums=...)`` runs each rank's body inside
``donated(<that rank's donated blocks>)``, and the functions that produce new state check
``is_donated`` before allocating -- ``cfx.optim``'s Adam sweep writes the new moments into the
old ones and the update into the gradient's buffer, ``apply_updates`` adds into the params. The
results are the same numbers as without donation; only where they live changes. Library code
may donate its own temporaries the same way (a gradient it made and will not read again).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch

from cfx._src.core import context

# Empty in a compiled region (context.Var): there the compiler owns every buffer, and cfx.jit's
# donate_argnums writes the outputs into the donated inputs itself.
_donated: context.Var[frozenset] = context.Var("cfx_donated", frozenset())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself (a fake tensor's has no address)


@contextlib.contextmanager
def donated(tensors: Iterable[Any]):
    """Inside, the storages of ``tensors`` (non-tensors ignored) may be overwritten (nothing, in
    a compiled region: see ``_donated``)."""
    if torch.compiler.is_dynamo_compiling():
        yield
        return
    keys = {_key(t) for t in tensors if isinstance(t, torch.Tensor) and t.numel()}
    token = _donated.set(_donated.get() | keys)
    try:
        yield
    finally:
        _donated.reset(token)


def is_donated(t: Any) -> bool:
    """True when ``t``'s storage was donated here (writing into it is allowed)."""
    keys = _donated.get()
    return bool(keys) and isinstance(t, torch.Tensor) and t.numel() > 0 and _key(t) in keys


def all_donated(ts: Iterable[Any]) -> bool:
    keys = _donated.get()
    return bool(keys) and all(isinstance(t, torch.Tensor) and t.numel() > 0 and _key(t) in keys for t in ts)


def assign(outs: list[Any], donated: list[torch.Tensor], fits: Callable[[int, int], bool], *,
           in_place: bool = True) -> dict[int, int]:
    """Which donated buffer each output goes into: ``{output index: donated index}``.

    First (``in_place``) the outputs already computed in a donated buffer keep it; then, in order,
    every other output takes the first free donated buffer it ``fits`` (same shape and dtype, and
    whatever else the caller asks), never one an output still lives in. Outputs left out are
    fresh; donated buffers left over are simply released."""
    taken: dict[int, int] = {}
    free = [j for j in range(len(donated)) if not is_deleted(donated[j])]  # given away inside already
    if in_place:
        at: dict[int, list[int]] = {}  # data_ptr -> the free donated buffers starting there
        for j in free:
            at.setdefault(donated[j].data_ptr(), []).append(j)
        claimed: set[int] = set()
        for i, x in enumerate(outs):
            for j in at.get(x.data_ptr(), ()) if isinstance(x, torch.Tensor) else ():
                if j not in claimed and fits(i, j):
                    taken[i] = j
                    claimed.add(j)
                    break
        free = [j for j in free if j not in claimed]
        busy = {_key(x) for x in outs if isinstance(x, torch.Tensor)}
        free = [j for j in free if _key(donated[j]) not in busy]
    for i, x in enumerate(outs):
        if i in taken or not isinstance(x, torch.Tensor):
            continue
        for j in free:
            if fits(i, j):
                taken[i] = j
                free.remove(j)
                break
    return taken


def write_into(outs: list[Any], donated: list[torch.Tensor], fits: Callable[[int, int], bool]) -> list[Any]:
    """``outs`` with each output that ``assign`` places in a donated buffer replaced by that
    buffer (written in place unless the output already lives there). Buffers the code inside
    already gave away (a ``cfx.jit`` body's donation) are not offered again."""
    outs = list(outs)
    with torch.no_grad():
        for i, j in assign(outs, donated, fits).items():
            b = donated[j]
            outs[i] = b if b.data_ptr() == outs[i].data_ptr() else b.copy_(outs[i])
    return outs


# -- deleted tensors ----------------------------------------------------------------------------
# What ``cfx.jit(..., donate_argnums=...)`` leaves in the caller's hands. The caller's tensor
# objects gave their buffers to the call's outputs. Each is emptied (it no longer shares the
# buffer it gave away) and turned into a ``DonatedTensor``, whose every use raises a ``ValueError``
# that names the function, the argument and the leaf -- JAX's "Array has been deleted", instead of
# silently reading the new values through an old name.


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
