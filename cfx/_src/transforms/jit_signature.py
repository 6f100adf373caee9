"""What a ``cfx.jit`` call is keyed on, and its arguments taken apart.

A call's key is its static arguments (by value: they must be hashable), the pytree structure of
the others, each tensor leaf's shape, dtype, device and ``requires_grad``, and the value of each
non-tensor leaf (a Python number in a pytree is a constant of the graph). Nothing else selects a
compiled graph, so nothing else recompiles.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from typing import Any, Callable, Hashable, Sequence

import torch

from cfx._src.core import donation, tree as tree_util
from cfx._src.core.donation import DonatedTensor


def argnums(name: str, what: str, nums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    if not all(isinstance(n, int) for n in nums):
        raise ValueError(f"cfx.jit({name}): {what} must be ints (positions of arguments), got {nums!r}.")
    return nums


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's arguments, taken apart."""

    key: Hashable                       # None where the caller asked for no key (an eager call)
    args: tuple                         # as given
    kwargs: dict
    statics: dict[int, Any]             # position -> value
    dynamic: tuple                      # the other positional arguments, in order
    tensors: list[torch.Tensor]         # every tensor leaf of ``dynamic`` and ``kwargs``, in leaf order
    donated: Sequence[int]              # positions in ``tensors`` given up to the call
    where: Callable[[int], str]         # "argument 0 leaf 'blocks.0.w'" for a position in ``tensors``
    storages: list[int] | None = None   # every tensor's storage key (``donation.storage_keys``), if any is donated


def split(name: str, args: tuple, kwargs: dict, *, static: tuple[int, ...], donate: tuple[int, ...],
          keyed: bool = True, last: list | None = None, shapes: bool = True) -> Call:
    """Key the call and take its arguments apart; every mistake raises before anything runs.
    ``keyed=False``: no key (the per-leaf specs are what an eager call would build for nothing);
    the checks are the same. ``last`` (unkeyed calls): a list holding the structures of the last
    call's arguments, read and updated here -- a train step passes the same structures every
    step, and its arguments' leaves are read through them (``tree.leaves_as``), quickly.
    ``shapes=False`` (``cfx.jit(dynamic=True)``): a tensor is keyed by its number of dims, not its sizes."""
    n = len(args)
    for what, nums in (("static_argnums", static), ("donate_argnums", donate)):
        for i in nums:
            if not -n <= i < n:
                raise ValueError(f"cfx.jit({name}): {what}={nums!r} but the call has {n} positional "
                                 "argument(s).")
    statics = {i % n: args[i % n] for i in sorted({i % n for i in static})} if static else {}
    for i, s in statics.items():
        try:
            hash(s)
        except TypeError:
            raise ValueError(f"cfx.jit({name}): static argument {i} is a {type(s).__name__}, which is not "
                             "hashable; a static argument keys the compiled graph by value. Pass it as a "
                             "dynamic argument (drop it from static_argnums), or make it hashable "
                             "(a tuple, a frozen dataclass).") from None
    dynamic = tuple(a for i, a in enumerate(args) if i not in statics) if statics else args
    parts = _walk([*dynamic, kwargs] if kwargs else dynamic, None if keyed else last)  # one walk per argument
    leaves = parts[0][0] if len(parts) == 1 else list(itertools.chain.from_iterable(part for part, _ in parts))
    treedef = tuple(td for _, td in parts) + (() if kwargs else (_NO_KWARGS,))
    layout = _layout(n, tuple(statics), donate, treedef)
    if keyed or not _plain(leaves):
        tensors, donated, specs, tensor_leaf = _leaves(name, layout, leaves, keyed, shapes)
    else:  # every leaf a plain tensor, nothing to key: the structure says which are donated
        tensors, donated, specs, tensor_leaf = leaves, layout.donated, None, None
    where = _Where(layout, tensor_leaf)
    storages = _check_donated_buffers(name, tensors, donated, where)
    key = (tuple(statics.items()), treedef, tuple(specs)) if keyed else None
    return Call(key, args, kwargs, statics, dynamic, tensors, donated, where, storages)


def _walk(trees: Sequence[Any], last: list | None) -> list[tuple[list, Any]]:
    """Each tree's leaves and structure, read through ``last[0]`` (the last call's structures)
    where they still fit; ``last[0]`` becomes this call's."""
    guess = last[0] if last else None
    if guess is not None and len(guess) == len(trees):
        fast = [tree_util.leaves_as(t, td) for t, td in zip(trees, guess)]
        if all(xs is not None for xs in fast):
            return list(zip(fast, guess))
    parts = [tree_util.flatten(t) for t in trees]
    if last is not None:
        last[:] = [tuple(td for _, td in parts)]
    return parts


_PLAIN = {torch.Tensor}
_requires_grad = operator.attrgetter("requires_grad")


def _plain(leaves: list) -> bool:
    """Every leaf a tensor of the plain class (no DonatedTensor, no constant, no ShardedArray)."""
    return set(map(type, leaves)) <= _PLAIN


def _leaves(name: str, layout: "_Layout", leaves: list, keyed: bool, shapes: bool = True) -> tuple:
    """The tensors among ``leaves`` (raising on leaves jit does not take), the donated ones'
    positions among them, each leaf's spec (``keyed``) and, where constants shift them, each
    tensor's leaf index (else None)."""
    donated_leaf = layout.donated_leaf
    tensors, donated, specs, tensor_leaf = [], [], [], None
    for k, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if isinstance(x, DonatedTensor):
                raise ValueError(f"cfx.jit({name}): {layout.where(k)}: {x._cfx_donated}")
            if donated_leaf is not None and donated_leaf[k]:
                donated.append(len(tensors))
            if tensor_leaf is not None:
                tensor_leaf.append(k)
            tensors.append(x)
            if keyed:
                specs.append((tuple(x.shape) if shapes else x.dim(), x.dtype, x.device, x.requires_grad))
            continue
        if hasattr(type(x), "__cfx_grad_leaf__"):
            raise ValueError(f"cfx.jit({name}): {layout.where(k)} is a {type(x).__name__}; jit takes tensors. Put "
                             "the jit inside the sharded program (cfx.shard_map(cfx.jit(f), ...)), where each rank "
                             "sees its own blocks as tensors.")
        try:
            hash(x)
        except TypeError:
            raise ValueError(f"cfx.jit({name}): {layout.where(k)} is a {type(x).__name__}, which is neither a "
                             "tensor nor a hashable constant. Make it a tensor, or pass it through "
                             "static_argnums.") from None
        if tensor_leaf is None:  # the tensors' leaf indices, once a constant shifts them
            tensor_leaf = list(range(len(tensors)))
        if keyed:
            specs.append(("const", type(x), x))
    return tensors, donated, specs, tensor_leaf


_NO_KWARGS = object()  # the structure of no keyword arguments (none are flattened)


class _Layout:
    """What a call's structure alone decides: which leaves are donated, and each leaf's name for
    errors (built only for an error). One per structure (``_layout``): a train step calls with
    the same structure every time, and none of this depends on the leaves' values."""

    def __init__(self, n: int, statics: tuple[int, ...], donate: tuple[int, ...], treedefs: tuple):
        self.dyn_pos = [i for i in range(n) if i not in statics]
        self.treedefs = [td for td in treedefs if td is not _NO_KWARGS]
        donate = {i % n for i in donate}
        flags, self.owner = [], []  # per leaf: donated?, and its part (a position in dyn_pos, or kwargs)
        for part, td in enumerate(self.treedefs):
            flags += [part < len(self.dyn_pos) and self.dyn_pos[part] in donate] * td.num_leaves
            self.owner += [part] * td.num_leaves
        self.donated_leaf = flags if any(flags) else None
        self.donated = tuple(k for k, f in enumerate(flags) if f)  # = positions in tensors, all leaves tensors
        self.paths: list[str] | None = None

    def where(self, k: int) -> str:
        """"argument 2 leaf 'blocks.0.w'" for leaf ``k``."""
        if self.paths is None:
            self.paths = [tree_util.path_str(a) for td in self.treedefs for a in td.accessors()]
        part, path = self.owner[k], self.paths[k]
        if part == len(self.dyn_pos):
            return f"keyword argument leaf {path!r}"
        return f"argument {self.dyn_pos[part]} leaf {path or '<root>'!r}"


_LAYOUTS: dict[tuple, _Layout] = {}


def _layout(n: int, statics: tuple[int, ...], donate: tuple[int, ...], treedefs: tuple) -> _Layout:
    key = (n, statics, donate, treedefs)
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 1024:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(n, statics, donate, treedefs)
    return layout


class _Where:
    """"argument 2 leaf 'blocks.0.w'" for a position in a call's ``tensors``. Holds no tensor:
    a deleted tensor's message (``donation.delete_all``) keeps it until it is first read."""

    def __init__(self, layout: _Layout, tensor_leaf: list[int] | None):
        self.layout, self.tensor_leaf = layout, tensor_leaf  # None: every leaf is a tensor

    def __call__(self, i: int) -> str:
        return self.layout.where(i if self.tensor_leaf is None else self.tensor_leaf[i])


def _check_donated_buffers(name: str, tensors: list, donated: list[int], where) -> list[int] | None:
    """Raise where a donated tensor requires grad or shares its buffer with another argument's;
    the tensors' storage keys (None where nothing is donated)."""
    if not donated:
        return None
    keys = donation.storage_keys(tensors)
    if not any(map(_requires_grad, map(tensors.__getitem__, donated))):
        if len(set(keys)) == len(keys):
            return keys  # no buffer shared, none differentiated: nothing below would raise
        counts = collections.Counter(keys)  # shared among the others only (tokens and targets views of one batch)?
        if max(map(counts.__getitem__, map(keys.__getitem__, donated))) == 1:
            return keys
    holders: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        holders.setdefault(key, []).append(i)
    for i in donated:
        if tensors[i].requires_grad:
            raise ValueError(f"cfx.jit({name}): donated {where(i)} requires grad; a donated buffer is "
                             "overwritten by the outputs, so it cannot be differentiated through. Donate "
                             "arguments that are not being differentiated (params between steps, optimizer "
                             "state), or drop them from donate_argnums.")
        others = [j for j in holders[keys[i]] if j != i]
        if others:
            raise ValueError(f"cfx.jit({name}): donated {where(i)} shares its buffer with {where(others[0])}; "
                             "a buffer can be given up only once, and not while another argument reads it. "
                             "Pass a copy (.clone()) of one of them.")
    return keys


def what_changed(last: list[tuple], now: list[tuple]) -> str:
    """Why a call keys a new signature after ``last``'s (each a list of ``(where, shape, dtype)`` per
    tensor leaf): a new batch size, say; each new shape, dtype or structure compiles once more."""
    if [w for w, _, _ in last] != [w for w, _, _ in now]:
        return "the arguments' structure or static values changed"
    for (where, shape, dtype), (_, old_shape, old_dtype) in zip(now, last):
        if shape != old_shape:
            return (f"{where} has shape {shape}, was {old_shape} (each new shape compiles once: keep batches to a "
                    "few sizes, or cfx.jit(..., dynamic=True) compiles one graph for every size)")
        if dtype != old_dtype:
            return f"{where} is {dtype}, was {old_dtype}"
    return "a static argument's value changed"
