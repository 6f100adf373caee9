"""What a ``cfx.jit`` call is keyed on, and its arguments taken apart.

A call's key is its static arguments (by value: they must be hashable), the pytree structure of
the others, each tensor leaf's shape, dtype, device and ``requires_grad``, and the value of each
non-tensor leaf (a Python number in a pytree is a constant of the graph). Nothing else selects a
compiled graph, so nothing else recompiles.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import torch

from cfx._src.core import tree as tree_util
from cfx._src.core.donation import DonatedTensor


def argnums(name: str, what: str, nums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    if not all(isinstance(n, int) for n in nums):
        raise ValueError(f"cfx.jit({name}): {what} must be ints (positions of arguments), got {nums!r}.")
    return nums


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's arguments, taken apart."""

    key: Hashable
    args: tuple                         # as given
    kwargs: dict
    statics: dict[int, Any]             # position -> value
    dynamic: tuple                      # the other positional arguments, in order
    tensors: list[torch.Tensor]         # every tensor leaf of ``dynamic`` and ``kwargs``, in leaf order
    donated: list[int]                  # positions in ``tensors`` given up to the call
    where: Callable[[int], str]         # "argument 0 leaf 'blocks.0.w'" for a position in ``tensors``


def split(name: str, args: tuple, kwargs: dict, *, static: tuple[int, ...], donate: tuple[int, ...]) -> Call:
    """Key the call and take its arguments apart; every mistake raises before anything runs."""
    n = len(args)
    for what, nums in (("static_argnums", static), ("donate_argnums", donate)):
        for i in nums:
            if not -n <= i < n:
                raise ValueError(f"cfx.jit({name}): {what}={nums!r} but the call has {n} positional "
                                 "argument(s).")
    static = {i % n for i in static}
    donate = {i % n for i in donate}
    statics = {i: args[i] for i in sorted(static)}
    for i, s in statics.items():
        try:
            hash(s)
        except TypeError:
            raise ValueError(f"cfx.jit({name}): static argument {i} is a {type(s).__name__}, which is not "
                             "hashable; a static argument keys the compiled graph by value. Pass it as a "
                             "dynamic argument (drop it from static_argnums), or make it hashable "
                             "(a tuple, a frozen dataclass).") from None
    dyn_pos = [i for i in range(n) if i not in static]
    dyn = (tuple(args[i] for i in dyn_pos), kwargs)
    parts = [tree_util.flatten(args[i]) for i in dyn_pos] + [tree_util.flatten(kwargs)]  # one walk in all
    leaves = [x for part, _ in parts for x in part]
    treedef = tuple(td for _, td in parts)
    where = _Where(dyn, dyn_pos)
    donated_leaf, start = set(), 0
    for i, (part, _) in zip(dyn_pos, parts):
        if i in donate:
            donated_leaf.update(range(start, start + len(part)))
        start += len(part)
    tensors, donated, consts, specs = [], [], set(), []
    for k, x in enumerate(leaves):
        if isinstance(x, DonatedTensor):
            raise ValueError(f"cfx.jit({name}): {where(k)}: {x._cfx_donated}")
        if isinstance(x, torch.Tensor):
            if k in donated_leaf:
                donated.append(len(tensors))
            tensors.append(x)
            specs.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
            continue
        if hasattr(type(x), "__cfx_grad_leaf__"):
            raise ValueError(f"cfx.jit({name}): {where(k)} is a {type(x).__name__}; jit takes tensors. Put the "
                             "jit inside the sharded program (cfx.shard_map(cfx.jit(f), ...)), where each rank "
                             "sees its own blocks as tensors.")
        try:
            hash(x)
        except TypeError:
            raise ValueError(f"cfx.jit({name}): {where(k)} is a {type(x).__name__}, which is neither a tensor "
                             "nor a hashable constant. Make it a tensor, or pass it through static_argnums.") from None
        consts.add(k)
        specs.append(("const", type(x), x))
    tensor_leaf = [k for k, x in enumerate(leaves) if k not in consts]
    _check_donated_buffers(name, tensors, donated, lambda i: where(tensor_leaf[i]))
    key = (tuple(statics.items()), treedef, tuple(specs))
    return Call(key, args, kwargs, statics, dyn[0], tensors, donated, lambda i: where(tensor_leaf[i]))


class _Where:
    """"argument 2 leaf 'blocks.0.w'" for a leaf index; paths are built only for an error."""

    def __init__(self, dyn: tuple, dyn_pos: list[int]):
        self.dyn, self.dyn_pos, self.paths = dyn, dyn_pos, None

    def __call__(self, k: int) -> str:
        if self.paths is None:
            self.paths = [p for p, _ in tree_util.flatten_with_path(self.dyn)[0]]
        head, _, rest = self.paths[k].partition(".")
        if head == "1":
            return f"keyword argument leaf {rest!r}"
        pos, _, leaf = rest.partition(".")
        return f"argument {self.dyn_pos[int(pos)]} leaf {leaf or '<root>'!r}"


def _check_donated_buffers(name: str, tensors: list, donated: list[int], where) -> None:
    if not donated:
        return
    holders: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        holders.setdefault(t.untyped_storage()._cdata, []).append(i)
    for i in donated:
        if tensors[i].requires_grad:
            raise ValueError(f"cfx.jit({name}): donated {where(i)} requires grad; a donated buffer is "
                             "overwritten by the outputs, so it cannot be differentiated through. Donate "
                             "arguments that are not being differentiated (params between steps, optimizer "
                             "state), or drop them from donate_argnums.")
        others = [j for j in holders[tensors[i].untyped_storage()._cdata] if j != i]
        if others:
            raise ValueError(f"cfx.jit({name}): donated {where(i)} shares its buffer with {where(others[0])}; "
                             "a buffer can be given up only once, and not while another argument reads it. "
                             "Pass a copy (.clone()) of one of them.")
