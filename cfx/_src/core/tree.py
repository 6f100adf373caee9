"""Pytree utilities over optree, in the ``cfx`` namespace.

Params, grads and optimizer states are pytrees of tensors (nested dicts, lists, tuples and
NamedTuples). ``None`` is an empty subtree, as in JAX. A leaf's *path* is a dotted string
(``blocks.3.attn.q.w``) used by sharding rules, checkpoints and error messages.
"""
from __future__ import annotations

import builtins
import itertools
from typing import Any, Callable, Iterable

import optree
import torch

from cfx._src.core import tree_traced

_compiling = torch.compiler.is_dynamo_compiling

NAMESPACE = "cfx"

PyTree = Any
PyTreeDef = optree.PyTreeSpec


# While torch.compile traces, the same walks run in plain Python (``tree_traced``): dynamo traces
# optree's C++ only through slow polyfills. Structures made there are nested tuples.

def leaves(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    if _compiling():
        return tree_traced.flatten(tree, is_leaf)[0]
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def structure(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> PyTreeDef:
    if _compiling():
        return tree_traced.flatten(tree, is_leaf)[2]
    return optree.tree_structure(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def flatten(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], PyTreeDef]:
    if _compiling():
        out = tree_traced.flatten(tree, is_leaf)
        return out[0], out[2]
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def leaves_as(tree: PyTree, treedef: PyTreeDef) -> list[torch.Tensor] | None:
    """``tree``'s leaves, all tensors, if it has ``treedef``'s structure; else None (flatten it).

    A walk guided by ``treedef`` (it looks dict keys up instead of sorting them: about a tenth of
    ``flatten``'s time on a model's params), for the hot paths that read the leaves of a tree they
    expect to be shaped like another -- an optimizer's moments like the gradients, a step's state
    like the last step's. Dict-like node types are not told apart (an ``OrderedDict`` reads as
    ``treedef``'s ``dict``): use it to read leaves, never to rebuild a tree from ``treedef``."""
    if isinstance(treedef, tuple) or _compiling():
        return None
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None
    # a subtree where treedef has a leaf comes back as one leaf: only tensors are sure to be leaves
    return leaves if all(builtins.map(isinstance, leaves, itertools.repeat(torch.Tensor))) else None


def unflatten(treedef: PyTreeDef, leaves: Iterable[Any]) -> PyTree:
    if isinstance(treedef, tuple):
        return tree_traced.unflatten(treedef, leaves)
    return optree.tree_unflatten(treedef, leaves)


def register_node(cls: type, flatten_fn: Callable[[Any], tuple], unflatten_fn: Callable[[Any, Any], Any]) -> None:
    """Make ``cls`` a pytree node: ``flatten_fn(x) -> (children, meta, entry names)``,
    ``unflatten_fn(meta, children) -> x``."""
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
    tree_traced.NODES[cls] = (flatten_fn, unflatten_fn)


def _entry_str(entry: Any) -> str:
    field = getattr(entry, "field", None)  # NamedTuple / dataclass entries carry a field name
    if isinstance(field, str):
        return field
    for attr in ("key", "name", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(getattr(entry, "entry", entry))


def path_str(path: Any) -> str:
    """A dotted path: ``("blocks", 3, "attn")`` or an optree accessor -> ``"blocks.3.attn"``.

    NamedTuple fields are named (``state.mu``), not numbered. The root is ``""``.
    """
    return ".".join(_entry_str(p) if not isinstance(p, (str, int)) else str(p) for p in path)


def flatten_with_path(
    tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[str, Any]], PyTreeDef]:
    """Leaves paired with their dotted path strings, and the tree structure."""
    if _compiling():
        leaves_, paths, treedef = tree_traced.flatten(tree, is_leaf, path="")
        return list(zip(paths, leaves_)), treedef
    leaves_, treedef = optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return list(zip(_paths_of(treedef), leaves_)), treedef


_PATHS: dict[PyTreeDef, tuple[str, ...]] = {}  # a structure's leaf paths: the same every step


def _paths_of(treedef: PyTreeDef) -> tuple[str, ...]:
    """The dotted leaf paths of a structure, built once per structure (a train step flattens the
    same few structures every call; building the strings was most of the cost)."""
    paths = _PATHS.get(treedef)
    if paths is None:
        if len(_PATHS) >= 4096:
            _PATHS.clear()
        paths = _PATHS[treedef] = tuple(path_str(a) for a in treedef.accessors())
    return paths


def leaf_paths(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    return [p for p, _ in flatten_with_path(tree, is_leaf=is_leaf)[0]]


def _mismatch_error(what: str, ref: PyTree, other: PyTree, index: int) -> ValueError:
    ref_paths = set(leaf_paths(ref))
    other_paths = set(leaf_paths(other))
    missing = sorted(ref_paths - other_paths)
    extra = sorted(other_paths - ref_paths)
    detail = []
    if missing:
        detail.append(f"missing leaves {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if extra:
        detail.append(f"unexpected leaves {extra[:5]}" + (" ..." if len(extra) > 5 else ""))
    if not detail:
        detail.append(f"structures differ: {structure(ref)} vs {structure(other)}")
    return ValueError(
        f"{what}: argument {index} does not have the structure of the first tree; "
        + "; ".join(detail)
        + ". Pass trees built from the same params (e.g. from the same model.init)."
    )


def check_same_structure(what: str, first: PyTree, *rest: PyTree) -> PyTreeDef:
    """Raise a ValueError naming the differing paths if any tree in ``rest`` differs from ``first``."""
    treedef = structure(first)
    for i, other in enumerate(rest, start=1):
        if structure(other) != treedef:
            raise _mismatch_error(what, first, other, i)
    return treedef


def map(f: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """``f`` applied leafwise over ``tree`` and trees of the same structure."""
    if rest and is_leaf is None:
        check_same_structure("cfx.tree.map", tree, *rest)
    if _compiling():
        xs, treedef = flatten(tree, is_leaf=is_leaf)
        others = [leaves(r, is_leaf=is_leaf) for r in rest]
        return unflatten(treedef, [f(*args) for args in zip(xs, *others)])
    return optree.tree_map(f, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def map_with_path(f: Callable[..., Any], tree: PyTree, *rest: PyTree,
                  is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """``f(path_str, leaf, *other_leaves)`` applied leafwise."""
    if rest and is_leaf is None:
        check_same_structure("cfx.tree.map_with_path", tree, *rest)
    if _compiling():
        items, treedef = flatten_with_path(tree, is_leaf=is_leaf)
        others = [leaves(r, is_leaf=is_leaf) for r in rest]
        return unflatten(treedef, [f(p, x, *o) for (p, x), *o in zip(items, *others)])
    return optree.tree_map_with_accessor(lambda a, *xs: f(path_str(a), *xs), tree, *rest,
                                         is_leaf=is_leaf, namespace=NAMESPACE)


def is_axes_leaf(x: Any) -> bool:
    """A leaf of an ``axes()`` tree: a tuple of logical axis names, one per tensor dim (``None``
    for a dim no rule names), e.g. ``("embed", "mlp")``."""
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def _is_array(x: Any) -> bool:
    """Tensors and the array-like leaves that stand for them (ShardedArray: its global size;
    ShapeDtype)."""
    return isinstance(x, torch.Tensor) or (hasattr(x, "numel") and hasattr(x, "element_size"))


def size(tree: PyTree) -> int:
    """Total number of elements over all tensor (or global array) leaves."""
    return sum(x.numel() for x in leaves(tree) if _is_array(x))


def nbytes(tree: PyTree) -> int:
    """Total bytes over all tensor (or global array) leaves."""
    return sum(x.numel() * x.element_size() for x in leaves(tree) if _is_array(x))


def allclose(a: PyTree, b: PyTree, *, rtol: float | None = None, atol: float | None = None) -> bool:
    """True when both trees have the same structure and every pair of leaves is close.

    Tolerances default to ``torch.testing.assert_close``'s for the leaves' dtype.
    """
    if structure(a) != structure(b):
        return False
    for x, y in zip(leaves(a), leaves(b)):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol, check_device=False)
            except AssertionError:
                return False
        elif x != y:
            return False
    return True


def assert_close(actual: PyTree, expected: PyTree, *, rtol: float | None = None,
                 atol: float | None = None) -> None:
    """``torch.testing.assert_close`` leafwise; the failure message names the leaf's path."""
    check_same_structure("assert_close", expected, actual)
    for (path, x), y in zip(flatten_with_path(actual)[0], leaves(expected)):
        try:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, check_device=False)
        except AssertionError as e:
            raise AssertionError(f"leaf {path or '<root>'!r}: {e}") from None


# the names until 0.2 (``cfx.tree.tree_size`` stuttered)
tree_size, tree_bytes, tree_allclose, assert_tree_close = size, nbytes, allclose, assert_close
