"""Pytree utilities: ``cfx.tree.map``, ``leaves``, ``flatten_with_path`` (dotted paths), ..."""
from cfx._src.core.tree import (
    PyTree,
    PyTreeDef,
    assert_tree_close,
    check_same_structure,
    flatten,
    flatten_with_path,
    leaf_paths,
    leaves,
    map,
    map_with_path,
    path_str,
    structure,
    tree_allclose,
    tree_bytes,
    tree_size,
    unflatten,
)

__all__ = [
    "PyTree", "PyTreeDef", "assert_tree_close", "check_same_structure", "flatten",
    "flatten_with_path", "leaf_paths", "leaves", "map", "map_with_path", "path_str", "structure",
    "tree_allclose", "tree_bytes", "tree_size", "unflatten",
]
