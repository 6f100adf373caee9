"""Spec pytrees against value pytrees: which ``P`` each leaf gets, and where they disagree.

``in_specs`` / ``out_specs`` (and ``init_sharded``'s ``specs``) are pytree *prefixes* of the
values: a ``P`` stands for a whole subtree. A mismatch is a ValueError naming the first path
where the structures part, what each side has there, the mesh and the fix.
"""
from __future__ import annotations

from typing import Any

import optree

from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P, is_spec


_ASSIGNED: dict = {}  # (spec structure, spec leaves, tree structure, what) -> (path, spec) per leaf


def broadcast_specs(specs: Any, tree: Any, what: str, mesh, *,
                    where: str = "shard_map") -> list[tuple[str, Any, P]]:
    """``(path, leaf, spec)`` for every leaf of ``tree`` with the spec its prefix assigns
    (worked out once per structure of the specs and of the tree: a step's boundary repeats it)."""
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=is_spec, none_is_leaf=True,
                                                namespace=tree_util.NAMESPACE)
    leaves, treedef = tree_util.flatten(tree)
    try:
        key = (spec_def, tuple((type(x), x) for x in spec_leaves), treedef, what)
        assigned = _ASSIGNED.get(key)
    except TypeError:  # an unhashable spec leaf: not a P (reported below)
        key = assigned = None
    if assigned is None:
        assigned = _assign(specs, tree, what, mesh, where)
        if key is not None:
            if len(_ASSIGNED) >= 1024:
                _ASSIGNED.clear()
            _ASSIGNED[key] = assigned
    return [(path, leaf, spec) for (path, spec), leaf in zip(assigned, leaves)]


def _assign(specs: Any, tree: Any, what: str, mesh, where: str) -> tuple[tuple[str, P], ...]:
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec, namespace=tree_util.NAMESPACE)
    except ValueError:
        at, why = prefix_mismatch(specs, tree)
        values = {"in_specs": "arguments", "out_specs": "outputs"}.get(what, "values")
        if what == "in_specs":
            at = _arg_path(at)
        raise ValueError(f"{where}: {what} do not match the {values} at {at or '<root>'!r} on {mesh!r}: "
                         f"{why}. Give one P per leaf, or a P for a whole subtree (a pytree prefix).") from None
    items, _ = tree_util.flatten_with_path(tree)
    spec_leaves = tree_util.leaves(full, is_leaf=is_spec)
    out = []
    for (path, leaf), spec in zip(items, spec_leaves):
        if what == "in_specs":
            path = _arg_path(path)
        if not is_spec(spec):
            raise ValueError(f"{where}: {what} leaf {path or '<root>'!r} must be a cfx.P spec, got "
                             f"{spec!r}.")
        out.append((path, spec))
    return tuple(out)


def _arg_path(path: str) -> str:
    """``"0.wte.w"`` -> ``"args[0].wte.w"``."""
    head, _, rest = path.partition(".")
    return f"args[{head}]" + (f".{rest}" if rest else "")


def prefix_mismatch(specs: Any, tree: Any, path: str = "") -> tuple[str, str]:
    """Where a spec pytree stops being a prefix of ``tree``: ``(dotted path, what differs)``."""
    ns = tree_util.NAMESPACE
    if is_spec(specs) or specs is None:
        return path, "a spec leaf here is fine"  # not reached for a real mismatch
    if optree.tree_is_leaf(specs, namespace=ns) or optree.tree_is_leaf(tree, namespace=ns):
        return path, f"the specs have a {type(specs).__name__} where the values have a {type(tree).__name__}"
    s1 = optree.tree_flatten_one_level(specs, namespace=ns)
    t1 = optree.tree_flatten_one_level(tree, namespace=ns)
    if type(specs) is not type(tree) or s1.entries != t1.entries:
        return path, (f"the specs have {type(specs).__name__} entries {list(s1.entries)} where the values have "
                      f"{type(tree).__name__} entries {list(t1.entries)}")
    for entry, sc, tc in zip(s1.entries, s1.children, t1.children):
        sub = f"{path}.{entry}" if path else str(entry)
        try:
            optree.tree_broadcast_prefix(sc, tc, is_leaf=is_spec, namespace=ns)
        except ValueError:
            return prefix_mismatch(sc, tc, sub)
    return path, "the structures differ"
