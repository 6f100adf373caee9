"""The plain-Python tree walk used while torch.compile traces agrees with optree on every tree:
the same leaves in the same order, the same paths, the same rebuilt containers; and ``cfx.tree``
really takes it inside a compiled function (and compiles fast)."""
from __future__ import annotations

import collections
from typing import NamedTuple

import optree
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.core import tree as tree_util
from cfx._src.core import tree_traced
from cfx._src.zero.params import ZeroParams


class Pair(NamedTuple):
    left: object
    right: object


leaf = st.one_of(st.integers(-3, 3), st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)))
keys = st.text("abcxyz", min_size=1, max_size=3)
trees = st.recursive(
    st.one_of(leaf, st.none()),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(keys, kids, max_size=3),
        st.dictionaries(keys, kids, max_size=3).map(collections.OrderedDict),
        st.builds(Pair, kids, kids),
        st.builds(lambda p: ZeroParams(p, (), 1), kids),
    ),
    max_leaves=12)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, ZeroParams):
        return _same(a.pieces, b.pieces)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@given(trees)
def test_the_traced_walk_agrees_with_optree(tree):
    items, treedef = tree_util.flatten_with_path(tree)  # optree
    leaves, paths, traced_def = tree_traced.flatten(tree, path="")
    assert paths == [p for p, _ in items]
    assert all(x is y for x, (_, y) in zip(leaves, items))
    rebuilt = tree_traced.unflatten(traced_def, leaves)
    assert _same(rebuilt, optree.tree_unflatten(treedef, leaves)) and _same(rebuilt, tree)


@given(trees, trees)
def test_the_traced_structures_are_equal_exactly_when_optrees_are(a, b):
    same_optree = tree_util.structure(a) == tree_util.structure(b)
    assert (tree_traced.flatten(a)[2] == tree_traced.flatten(b)[2]) == same_optree


def test_cfx_tree_walks_in_python_while_compiling():
    tree = {"b": [torch.ones(2), None], "a": Pair(torch.zeros(3), {"z": torch.ones(1), "y": torch.ones(1)})}
    seen = []

    def f(t):
        out = cfx.tree.map(lambda x: x * 2, t)
        seen.append(type(cfx.tree.structure(t)))
        return cfx.tree.unflatten(cfx.tree.structure(out), cfx.tree.leaves(out))

    out = torch.compile(f, fullgraph=True, backend="eager")(tree)
    assert seen == [tuple]  # traced once, through tree_traced (optree's structures are PyTreeSpecs)
    assert _same(out, cfx.tree.map(lambda x: x * 2, tree))
