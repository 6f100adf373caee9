"""tree_recurring.Recurring: the same leaves and structure as cfx.tree.flatten, call after call, and
a tree rebuilt from them that is the tree flattened (node types, dict key order, the leaves)."""
import collections
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.core import tree_recurring
from cfx._src.core.tree_recurring import Recurring
from cfx._src.nn.lora_weight import LoraWeight


class Pair(NamedTuple):
    a: object
    b: object


class Name(str):
    """A key equal to a plain str key, of another type."""


_leaves = st.integers(1, 3).map(lambda n: torch.full((n,), float(n)))
_trees = st.recursive(
    _leaves | st.none(),
    lambda kids: (st.dictionaries(st.sampled_from("abcde"), kids, max_size=4)
                  | st.lists(kids, max_size=3) | st.lists(kids, max_size=3).map(tuple)
                  | st.tuples(kids, kids).map(lambda ab: Pair(*ab))),
    max_leaves=10)


def _vary(x, draw):
    """``x`` with fresh containers of the same key sets, each dict perhaps of another kind, keys in
    another order or one key of another type, each leaf perhaps a number or a container."""
    if isinstance(x, dict):
        items = [(k, _vary(v, draw)) for k, v in x.items()]
        how = draw(st.sampled_from(["same"] * 6 + ["reversed", "ordered", "default", "subclass key"]))
        if how == "reversed":
            items.reverse()
        if how == "ordered":
            return collections.OrderedDict(items)
        if how == "default":
            return collections.defaultdict(list, items)
        if how == "subclass key" and items:
            items[0] = (Name(items[0][0]), items[0][1])
        return dict(items)
    if isinstance(x, (list, tuple)):
        kids = [_vary(v, draw) for v in x]
        return type(x)(*kids) if isinstance(x, Pair) else type(x)(kids)
    if isinstance(x, torch.Tensor):
        return draw(st.sampled_from([x] * 8 + [3, {"z": x}]))
    return x


def _shape(x):
    """Everything an exact rebuild keeps: node types, dict keys (and their types) in order, a
    defaultdict's factory, and which leaf sits where."""
    if isinstance(x, dict):
        return (type(x), getattr(x, "default_factory", None), [(type(k), k, _shape(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x), [_shape(v) for v in x])
    return x if x is None or isinstance(x, int) else id(x)


def _check(r: Recurring, tree) -> None:
    leaves, treedef = r.flatten(tree)
    want, want_def = cfx.tree.flatten(tree)
    assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want))
    assert treedef == want_def
    assert _shape(cfx.tree.unflatten(treedef, leaves)) == _shape(tree)


@given(_trees, st.data())
def test_recurring_flatten_is_flatten_call_after_call(tree, data):
    r = Recurring()
    calls = [tree, _vary(tree, data.draw), tree, tree] + [_vary(tree, data.draw) for _ in range(4)] + [tree]
    for t in calls:
        _check(r, t)


def _sample():
    return (Pair({"wte": torch.ones(2), "blocks": [{"w": torch.ones(1), "b": torch.zeros(1)}]},
                 (torch.tensor(3), None)), torch.tensor(1.0))


def test_a_recurring_structure_is_read_without_flattening(monkeypatch):
    r = Recurring()
    r.flatten(_sample())
    r.flatten(_sample())  # twice: now it has a reader
    flat = cfx.tree.flatten

    def refused(tree):
        raise AssertionError("flattened")
    monkeypatch.setattr(tree_recurring.tree_util, "flatten", refused)
    tree = _sample()
    leaves, treedef = r.flatten(tree)
    monkeypatch.setattr(tree_recurring.tree_util, "flatten", flat)
    want, want_def = cfx.tree.flatten(tree)
    assert treedef == want_def and all(a is b for a, b in zip(leaves, want)) and len(leaves) == 5


@pytest.mark.parametrize("change", ["ordered dict", "key order", "str subclass key", "number leaf"])
def test_what_the_reader_cannot_vouch_for_is_flattened(change):
    r = Recurring()
    r.flatten(_sample())
    r.flatten(_sample())
    tree = _sample()
    params = tree[0].a
    if change == "ordered dict":
        tree = (tree[0]._replace(a=collections.OrderedDict(params)), tree[1])
    elif change == "key order":
        tree = (tree[0]._replace(a={"blocks": params["blocks"], "wte": params["wte"]}), tree[1])
    elif change == "str subclass key":
        tree = (tree[0]._replace(a={Name("wte"): params["wte"], "blocks": params["blocks"]}), tree[1])
    else:
        tree = (tree[0]._replace(a={**params, "wte": 2.0}), tree[1])
    _check(r, tree)
    _check(r, _sample())  # and the usual structure still reads


def test_registered_nodes_are_always_flattened():
    def tree(scale):
        return {"w": LoraWeight(torch.ones(2, 2), torch.ones(2, 1), torch.zeros(1, 2), scale)}
    r = Recurring()
    for scale in (1.0, 1.0, 2.0, 2.0):  # metadata flatten_up_to would not check
        leaves, treedef = r.flatten(tree(scale))
        assert cfx.tree.unflatten(treedef, leaves)["w"].scale == scale
    assert r._last[1] is tree_recurring._UNREADABLE
