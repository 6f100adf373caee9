"""Pytree utilities: ``cfx.tree.map``, ``leaves``, ``flatten_with_path`` (dotted paths), ``size`` /
``nbytes`` of the tensor leaves, ``allclose`` / ``assert_close`` leafwise, ``is_axes_leaf`` for
``model.axes()`` trees. ``tree_size``, ``tree_bytes``, ``tree_allclose`` and ``assert_tree_close`` are
the old names of four of them (kept until 0.2)."""
from cfx._src.core.tree import (
    PyTree,
    PyTreeDef,
    allclose,
    assert_close,
    assert_tree_close,
    check_same_structure,
    flatten,
    flatten_with_path,
    is_axes_leaf,
    leaf_paths,
    leaves,
    map,
    map_with_path,
    nbytes,
    path_str,
    size,
    structure,
    tree_allclose,
    tree_bytes,
    tree_size,
    unflatten,
)

__all__ = [
    "PyTree", "PyTreeDef", "allclose", "assert_close", "assert_tree_close", "check_same_structure", "flatten",
    "flatten_with_path", "is_axes_leaf", "leaf_paths", "leaves", "map", "map_with_path", "nbytes", "path_str", "size",
    "structure", "tree_allclose", "tree_bytes", "tree_size", "unflatten",
]
