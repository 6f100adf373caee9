"""``cfx.tree``'s flatten and unflatten in plain Python, for code that ``torch.compile`` traces.

optree runs in C++, which dynamo cannot see into: it replays it through Python polyfills that cost
tens of milliseconds per leaf to trace (a GPT-2 step's trees took minutes). This module walks the
same containers with the same rules -- dict keys sorted (an ``OrderedDict`` keeps its order),
``None`` an empty subtree, NamedTuples by field, nodes registered with ``tree.register_node`` --
in a few lines dynamo inlines quickly. ``cfx.tree`` dispatches here only while compiling, and its
structures are plain nested tuples, compared with ``==``.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

# (flatten: x -> (children, meta, names), unflatten: (meta, children) -> x) per registered class
NODES: dict[type, tuple[Callable, Callable]] = {}

LEAF = ("*",)


def _children(x: Any) -> tuple[str, Any, list, list] | None:
    """(kind, meta, children, entry names) of a container; None for a leaf."""
    t = type(x)
    if x is None:
        return "none", None, [], []
    if t in NODES:
        children, meta, names = NODES[t][0](x)
        return "node", (t, meta), list(children), list(names)
    if isinstance(x, dict):
        keys = list(x) if isinstance(x, collections.OrderedDict) else sorted(x)
        return "dict", (t, tuple(keys), tuple(x), getattr(x, "default_factory", None)), [x[k] for k in keys], keys
    if isinstance(x, tuple) and getattr(t, "_fields", None) is not None:  # (torch 2.11 traces no hasattr on a class)
        return "namedtuple", t, list(x), list(t._fields)
    if isinstance(x, (tuple, list)):
        return t.__name__, t, list(x), list(range(len(x)))
    return None


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None, path: str | None = None
            ) -> tuple[list, list[str] | None, tuple]:
    """(leaves, their dotted paths when ``path`` is given, structure)."""
    leaves: list = []
    paths: list[str] | None = [] if path is not None else None

    def walk(x: Any, where: str | None) -> tuple:
        if is_leaf is not None and is_leaf(x):
            node = None
        else:
            node = _children(x)
        if node is None:
            leaves.append(x)
            if paths is not None:
                paths.append(where)
            return LEAF
        kind, meta, children, names = node
        subs = tuple(walk(c, None if where is None else f"{where}.{n}" if where else str(n))
                     for c, n in zip(children, names))
        return (kind, meta, subs)

    treedef = walk(tree, path)
    return leaves, paths, treedef


def unflatten(treedef: tuple, leaves: Any) -> Any:
    it = iter(leaves)

    def build(d: tuple) -> Any:
        if d is LEAF or d == LEAF:
            return next(it)
        kind, meta, subs = d
        children = [build(s) for s in subs]
        if kind == "none":
            return None
        if kind == "node":
            return NODES[meta[0]][1](meta[1], children)
        if kind == "dict":
            t, keys, order, factory = meta
            vals = dict(zip(keys, children))
            items = [(k, vals[k]) for k in order]
            return t(factory, items) if t is collections.defaultdict else t(items)
        if kind == "namedtuple":
            return meta(*children)
        return meta(children)

    return build(treedef)
