"""Flattening a structure that recurs: a train step's state has the same structure every step.

``tree.flatten`` walks every node and sorts every dict's keys (about 0.3 us a node: 60-70 us for
GPT-2's step state, params and both Adam moments). ``Recurring().flatten(tree)`` gives exactly
what it gives -- the same leaves, an equal structure -- and reads a tree whose structure is the
last one's in C-level passes: ``flatten_up_to`` through that structure (the leaves; list, tuple
and NamedTuple types and lengths, dict key sets), then the dicts, gathered level by level from
the root, each checked to be a plain ``dict`` with its ``str`` keys in the recorded order --
``flatten_up_to`` tells neither ``OrderedDict`` nor key order apart, and a tree rebuilt from a
structure takes both from it. Anything else falls back to ``tree.flatten``.

Only structures of plain dicts with ``str`` keys, lists, tuples, NamedTuples and ``None`` over
tensor leaves are read this way: a registered node's metadata or a dict subclass's extras would
need checks of their own, so structures holding them are always flattened.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

import optree
import torch

from cfx._src.core import tree as tree_util

_chain = itertools.chain.from_iterable

_PLACEHOLDER = object()  # what a skeleton (a structure's tree of placeholders) holds at each leaf


class Recurring:
    """``flatten`` for trees that usually have the last one's structure (see the module). Keeps
    the last structure; builds its reader once the structure has come twice in a row (a caller
    alternating between structures pays one failed read at most, never a reader per call).
    Shared by threads: each call reads and replaces one immutable tuple."""

    def __init__(self):
        self._last: tuple[Any, Any] = (None, None)  # (structure, its _Reader, _UNREADABLE or None)

    def flatten(self, tree: Any) -> tuple[list, tree_util.PyTreeDef]:
        """``tree_util.flatten(tree)``: the same leaves and an equal structure."""
        if torch.compiler.is_dynamo_compiling():  # (a graph keeps no state of the last call)
            return tree_util.flatten(tree)
        treedef, reader = self._last
        leaves = reader.leaves(tree) if isinstance(reader, _Reader) else None
        if leaves is not None:
            return leaves, treedef
        leaves, new = tree_util.flatten(tree)
        if new != treedef:
            self._last = (new, None)
        elif reader is None:  # the same structure twice in a row: worth a reader
            self._last = (new, _Reader.of(new) or _UNREADABLE)
        else:  # its reader refused this very structure (a leaf not a tensor): flatten it from now on
            self._last = (new, _UNREADABLE)
        return leaves, new


_UNREADABLE = object()


class _Reader:
    """One structure, read fast: ``flatten_up_to`` through it gives the leaves and checks list,
    tuple and NamedTuple types and lengths and dict key sets; then the dicts, gathered level by
    level from the root (a dict's values, a sequence's items, in C-level passes), must each be a
    plain ``dict`` whose ``str`` keys come in the recorded order (``flatten_up_to`` tells neither
    ``OrderedDict`` nor key order apart, and a tree rebuilt from the structure takes both from it)."""

    def __init__(self, treedef: tree_util.PyTreeDef, skeleton: Any):
        self.treedef, self.levels = treedef, []  # per level: (its dicts' keys, getters of its dicts, sequences)
        nodes = [skeleton]
        while nodes:
            dicts = [i for i, x in enumerate(nodes) if type(x) is dict]
            seqs = [i for i, x in enumerate(nodes) if type(x) is not dict and x is not _PLACEHOLDER
                    and x is not None]
            self.levels.append(([k for i in dicts for k in nodes[i]], _getter(dicts), _getter(seqs)))
            nodes = [*_chain(nodes[i].values() for i in dicts), *_chain(nodes[i] for i in seqs)]
        while self.levels and self.levels[-1][1] is None:  # (no dict below: nothing left to check)
            self.levels.pop()

    @classmethod
    def of(cls, treedef: tree_util.PyTreeDef) -> "_Reader | None":
        """A reader of ``treedef``, or None where it holds a node this reads inexactly."""
        skeleton = optree.tree_unflatten(treedef, [_PLACEHOLDER] * treedef.num_leaves)
        return cls(treedef, skeleton) if _readable(skeleton) else None

    def leaves(self, tree: Any) -> list | None:
        """``tree``'s leaves where its structure is exactly ``treedef`` over tensor leaves, else None."""
        try:
            leaves = self.treedef.flatten_up_to(tree)
            nodes, found, keys = [tree], [], []
            for want, dicts_at, seqs_at in self.levels:
                dicts = dicts_at(nodes) if dicts_at is not None else ()
                ks = list(_chain(dicts))  # (a dict iterates its keys)
                if ks != want:  # another order: stop here
                    return None
                found += dicts
                keys += ks
                nodes = [*_chain(map(dict.values, dicts)), *_chain(seqs_at(nodes) if seqs_at is not None else ())]
        except (ValueError, TypeError):
            return None
        if found and (set(map(type, found)) != _DICT or set(map(type, keys)) - _STR):
            return None  # a dict subclass, or a key equal to a str but of another type
        kinds = set(map(type, leaves))
        if kinds - _TENSOR and not all(issubclass(k, torch.Tensor) and _is_leaf_type(k) for k in kinds):
            return None  # a leaf where a subtree would be
        return leaves


_DICT, _TENSOR, _STR = {dict}, {torch.Tensor}, {str}


def _getter(positions: list[int]) -> Callable | None:
    """``positions``' items of a list, as a tuple, in one C-level call (None for no positions)."""
    if not positions:
        return None
    if len(positions) == 1:
        return lambda xs, i=positions[0]: (xs[i],)
    return operator.itemgetter(*positions)


def _is_leaf_type(cls: type) -> bool:
    return optree.register_pytree_node.get(cls, namespace=tree_util.NAMESPACE) is None


def _readable(skeleton: Any) -> bool:
    """Whether every node is a plain dict with ``str`` keys, a list, tuple, NamedTuple or None."""
    todo = [skeleton]
    while todo:
        x = todo.pop()
        if x is _PLACEHOLDER or x is None:
            continue
        kind = type(x)
        if kind is dict and all(type(k) is str for k in x):  # (a key of another type may equal a str)
            todo += x.values()
        elif kind is list or kind is tuple or optree.is_namedtuple_class(kind):
            todo += x
        else:
            return False
    return True

