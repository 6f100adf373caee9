"""Donated buffers: storages a caller has given up, so the code it calls may overwrite them.

JAX's donation, eager: ``shard_map(..., donate_argnums=...)`` runs each rank's body inside
``donated(<that rank's donated blocks>)``, and the functions that produce new state check
``is_donated`` before allocating -- ``cfx.optim``'s Adam sweep writes the new moments into the
old ones and the update into the gradient's buffer, ``apply_updates`` adds into the params. The
results are the same numbers as without donation; only where they live changes. Library code
may donate its own temporaries the same way (a gradient it made and will not read again).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import operator
from typing import Any, Callable, Iterable, Sequence

import torch

from cfx._src.core import context

class _Given:
    """What is donated here: the donated tensor objects (by id) at once, and the keys of their
    storages when first asked for -- code reading the very leaves it was given (an optimizer's
    state) finds them by identity, and only a view of a donated buffer needs the storages."""

    __slots__ = ("ids", "own", "_tensors", "_keys", "_outer")

    def __init__(self, outer: "_Given | None", tensors: list, keys: list[int] | None):
        self._outer, self._tensors, self._keys = outer, tensors, keys  # keys: the caller's, all tensors'
        self.own = frozenset(map(id, tensors))  # these tensors' ids (``ids`` adds the outer contexts')
        self.ids = self.own if outer is None or not outer.ids else outer.ids | self.own

    def keys(self) -> frozenset:
        """The storage keys of the donated tensors but the empty ones (which have no buffer)."""
        if not isinstance(self._keys, frozenset):
            ts, keys = self._tensors, self._keys
            if keys is None:
                keys = storage_keys([t for t in ts if _numel(t)])
            elif not all(map(_numel, ts)):
                keys = [k for t, k in zip(ts, keys) if _numel(t)]
            self._keys = frozenset(keys)
        if self._outer is not None and self._outer.ids:
            return self._keys | self._outer.keys()
        return self._keys


# Nothing in a compiled region (context.Var): there the compiler owns every buffer, and cfx.jit's
# donate_argnums writes the outputs into the donated inputs itself.
_donated: context.Var[_Given] = context.Var("cfx_donated", _Given(None, [], ()))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself (a fake tensor's has no address)


_storage, _cdata, _numel = torch.Tensor.untyped_storage, operator.attrgetter("_cdata"), torch.Tensor.numel


@contextlib.contextmanager
def donated(tensors: Iterable[Any], *, keys: Iterable[int] | None = None):
    """Inside, the storages of ``tensors`` (non-tensors ignored) may be overwritten (nothing, in
    a compiled region: see ``_donated``). ``keys``: the storage keys of ``tensors`` (``storage_keys``;
    all tensors then), where the caller has them already; else they are read when first needed.
    Gives the tensors' ids (a frozenset; None in a compiled region)."""
    if torch.compiler.is_dynamo_compiling():
        yield None
        return
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    if keys is None and not all(map(isinstance, tensors, itertools.repeat(torch.Tensor))):
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    keys = keys if keys is None or isinstance(keys, list) else list(keys)
    given = _Given(_donated.get(), tensors, keys)
    token = _donated.set(given)
    try:
        yield given.own
    finally:
        _donated.reset(token)


def storage_keys(ts: Sequence[torch.Tensor]) -> list[int]:
    """``_key`` of each tensor of ``ts``, in one pass."""
    return list(map(_cdata, map(_storage, ts)))


def is_donated(t: Any) -> bool:
    """True when ``t``'s storage was donated here (writing into it is allowed)."""
    given = _donated.get()
    if not given.ids or not isinstance(t, torch.Tensor) or not t.numel():
        return False
    return id(t) in given.ids or _key(t) in given.keys()


def all_donated(ts: Iterable[Any]) -> bool:
    given = _donated.get()
    if not given.ids:
        return False
    ts = ts if isinstance(ts, (list, tuple)) else list(ts)
    if given.ids.issuperset(map(id, ts)):  # the donated tensors themselves
        return True
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return False
    return all(map(_numel, ts)) and given.keys().issuperset(map(_cdata, map(_storage, ts)))


def assign(outs: list[Any], donated: list[torch.Tensor], fits: Callable[[int, int], bool], *,
           in_place: bool = True, distinct: bool = False) -> dict[int, int]:
    """Which donated buffer each output goes into: ``{output index: donated index}``.

    First (``in_place``) the outputs already computed in a donated buffer keep it (a donated
    tensor returned as it is fits its own); then, in order, every other output takes the first
    free donated buffer it ``fits`` (same shape and dtype, and whatever else the caller asks),
    never one an output still lives in. Outputs left out are fresh; donated buffers left over are
    simply released. ``distinct``: the caller checked that no two donated tensors share a storage
    (then an output kept in one's buffer cannot live in another's)."""
    taken: dict[int, int] = {}
    if DonatedTensor in set(map(type, donated)):
        free = [j for j in range(len(donated)) if not is_deleted(donated[j])]  # given away inside already
    else:
        free = list(range(len(donated)))
    if in_place:
        taken = _returned_as_is(outs, donated, free)
        if len(taken) < len(free):  # (an in-place step returns every buffer as itself: done)
            kept = set(taken.values())
            taken.update(_kept_in_place(outs, donated, [j for j in free if j not in kept], fits, skip=taken))
        claimed = set(taken.values())
        if len(claimed) == len(free):  # every buffer kept its output: none to offer
            return taken
        free = [j for j in free if j not in claimed]
        rest = [i for i in range(len(outs)) if i not in taken]
        busy = {_key(outs[i]) for i in (rest if distinct else range(len(outs))) if isinstance(outs[i], torch.Tensor)}
        free = [j for j in free if _key(donated[j]) not in busy]
    else:
        rest = range(len(outs))
    for i in rest:
        x = outs[i]
        if not free:
            break
        if not isinstance(x, torch.Tensor):
            continue
        for j in free:
            if fits(i, j):
                taken[i] = j
                free.remove(j)
                break
    return taken


def returned_once(outs: list[Any], donated: list[torch.Tensor], ids: frozenset | None = None) -> list[bool] | None:
    """Per output, whether it is one of ``donated`` returned as it is -- where every donated tensor
    is returned so exactly once: an in-place step's outputs, each of which keeps its own buffer
    (what ``assign`` and ``write_into`` would decide, in a few C-level passes); None otherwise.
    ``ids``: ``donated``'s ids, where the caller has them (``donated(...)``'s context gives them).
    (A donated tensor deleted inside and returned raises when the caller detaches it, as it would
    after ``assign``.)"""
    ids = frozenset(map(id, donated)) if ids is None else ids
    out_ids = list(map(id, outs))
    flags = list(map(ids.__contains__, out_ids))
    if flags.count(True) != len(donated) or len(ids) != len(donated) or not ids.issubset(out_ids):
        return None
    return flags


def fresh(outs: list[Any], kept: list[bool]) -> list[Any]:
    """``outs`` with each ``kept`` one made a new tensor object on its buffer (``detach``): the
    caller's old name for it is deleted, the new one lives on. The others are kept as they are,
    but those that require grad, detached. In C-level passes where most are kept tensors (an
    in-place step's outputs): all detached, then the few others put back."""
    others = kept.count(False)
    if others * 4 > len(kept) or not all(map(isinstance, outs, itertools.repeat(torch.Tensor))):
        return [x.detach() if k or (isinstance(x, torch.Tensor) and x.requires_grad) else x
                for x, k in zip(outs, kept)]
    new = list(map(torch.Tensor.detach, outs))
    for i in itertools.compress(range(len(outs)), map(operator.not_, kept)) if others else ():
        if not outs[i].requires_grad:
            new[i] = outs[i]
    return new


def _returned_as_is(outs: list[Any], donated: list[torch.Tensor], free: list[int]) -> dict[int, int]:
    """``assign``'s first pass: each free donated tensor returned as it is (by the first output that
    is it) keeps its buffer. By identity alone: in an in-place step that is every buffer but the few
    (a step counter) computed anew, so the passes over buffers below run over those few."""
    ids = list(map(id, donated))
    at = dict(zip(ids, range(len(ids)))) if len(free) == len(ids) else {ids[j]: j for j in free}
    taken = {i: j for i, j in enumerate(map(at.get, map(id, outs))) if j is not None}
    if len(set(taken.values())) < len(taken):  # a tensor returned twice: its first output keeps it
        seen: set[int] = set()
        taken = {i: j for i, j in taken.items() if not (j in seen or seen.add(j))}
    return taken


def _kept_in_place(outs: list[Any], donated: list[torch.Tensor], free: list[int],
                   fits: Callable[[int, int], bool], *, skip: dict[int, int]) -> dict[int, int]:
    """``assign``'s second pass: in order, each output (but those in ``skip``) computed in a free
    donated buffer (starting where it starts, and fitting it) keeps that buffer, unless an earlier
    output took it."""
    at: dict[int, list[int]] = {}  # data_ptr -> the free donated buffers starting there
    for j in free:
        at.setdefault(donated[j].data_ptr(), []).append(j)
    taken: dict[int, int] = {}
    claimed: set[int] = set()
    for i, x in enumerate(outs):
        if i in skip:
            continue
        for j in at.get(x.data_ptr(), ()) if isinstance(x, torch.Tensor) else ():
            if j not in claimed and (x is donated[j] or fits(i, j)):
                taken[i] = j
                claimed.add(j)
                break
    return taken


def write_into(outs: list[Any], donated: list[torch.Tensor], fits: Callable[[int, int], bool], *,
               distinct: bool = False, taken: dict[int, int] | None = None) -> list[Any]:
    """``outs`` with each output that ``assign`` places in a donated buffer replaced by that
    buffer (written in place unless the output already lives there). Buffers the code inside
    already gave away (a ``cfx.jit`` body's donation) are not offered again. ``taken``:
    ``assign``'s answer, where the caller has it already."""
    outs = list(outs)
    if taken is None:
        taken = assign(outs, donated, fits, distinct=distinct)
    with torch.no_grad():
        for i, j in taken.items():
            b, x = donated[j], outs[i]
            if x is not b:
                outs[i] = b if b.data_ptr() == x.data_ptr() else b.copy_(x)
    return outs


# -- deleted tensors ----------------------------------------------------------------------------
# What ``cfx.jit(..., donate_argnums=...)`` leaves in the caller's hands. The caller's tensor
# objects gave their buffers to the call's outputs. Each is turned into a ``DonatedTensor``, whose
# every use raises a ``ValueError`` that names the function, the argument and the leaf -- JAX's
# "Array has been deleted", instead of silently reading the new values through an old name -- and
# emptied (it no longer shares the buffer it gave away), unless an output holds that buffer now:
# emptying it would free nothing while the output lives, and an in-place step would pay for it on
# every leaf of its state.


class DonatedTensor(torch.Tensor):
    """A tensor whose buffer was donated to a ``cfx.jit`` call; every use raises."""

    @property
    def _cfx_donated(self) -> str:
        """Why it is gone: the error message, built when first asked for (``delete_all``)."""
        gone = self.__dict__  # shared by the tensors one delete_all deleted (see there)
        k = gone["_cfx_ids"].index(id(self))
        said = gone["_cfx_said"]
        if k not in said:
            said[k] = gone["_cfx_why"](k)
        return said[k]

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


def delete(t: torch.Tensor, why: str | Callable[[], str]) -> None:
    """Empty ``t`` and make every later use of it raise ``ValueError(why)`` (``why()``: the
    message, built on first use)."""
    delete_all([t], lambda k: why if isinstance(why, str) else why())


def delete_all(ts: Sequence[torch.Tensor], why: Callable[[int], str], *,
               held: Iterable[int] | None = ()) -> None:
    """``delete`` each of ``ts``, ``ts[k]`` with the message ``why(k)``, built on first use (a
    step deletes a whole state's worth of tensors; almost none is ever used again). ``held``: the
    positions whose buffers outputs hold now (``assign``'s); those are not emptied (None: all, as
    after an in-place step). The deleted tensors share one ``__dict__``, which finds each one's
    position by its id (alive while it is) and keeps the messages built."""
    gone = {"_cfx_why": why, "_cfx_ids": list(map(id, ts)), "_cfx_said": {}}
    if held is None:  # (two C-level passes)
        collections.deque(map(setattr, ts, itertools.repeat("__class__"), itertools.repeat(DonatedTensor)), 0)
        collections.deque(map(setattr, ts, itertools.repeat("__dict__"), itertools.repeat(gone)), 0)
        return
    held = set(held)
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # one switch for the lot (set_ on a view of a grad tensor)
    try:
        for k, t in enumerate(ts):
            if k not in held:
                t.set_()
            t.__class__ = DonatedTensor
            t.__dict__ = gone
    finally:
        torch._C._set_grad_enabled(prev)


def is_deleted(x: Any) -> bool:
    return isinstance(x, DonatedTensor)
