"""cfx.tree against hand-computed answers."""
from typing import NamedTuple

import pytest
import torch

import cfx


class State(NamedTuple):
    mu: dict
    count: torch.Tensor


def sample():
    return {"blocks": [{"w": torch.ones(2, 3), "b": torch.zeros(3)}, {"w": torch.ones(3, 1), "b": None}],
            "state": State(mu={"x": torch.arange(4.0)}, count=torch.tensor(3))}


def test_flatten_with_path_gives_dotted_paths_in_order():
    items, treedef = cfx.tree.flatten_with_path(sample())
    assert [p for p, _ in items] == ["blocks.0.b", "blocks.0.w", "blocks.1.w", "state.mu.x", "state.count"]
    rebuilt = cfx.tree.unflatten(treedef, [x for _, x in items])
    assert cfx.tree.tree_allclose(rebuilt, sample())


def test_leaves_structure_and_map():
    t = sample()
    assert len(cfx.tree.leaves(t)) == 5
    doubled = cfx.tree.map(lambda x: x * 2, t)
    torch.testing.assert_close(doubled["state"].mu["x"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert isinstance(doubled["state"], State)
    assert cfx.tree.structure(doubled) == cfx.tree.structure(t)
    summed = cfx.tree.map(lambda a, b: a + b, t, doubled)
    torch.testing.assert_close(summed["blocks"][0]["w"], torch.full((2, 3), 3.0))


def test_map_with_path():
    out = cfx.tree.map_with_path(lambda p, x: p, {"a": {"b": torch.zeros(1)}, "c": [torch.zeros(1)]})
    assert out == {"a": {"b": "a.b"}, "c": ["c.0"]}


def test_size_and_bytes():
    t = {"a": torch.zeros(2, 3, dtype=torch.float32), "b": torch.zeros(5, dtype=torch.bfloat16)}
    assert cfx.tree.tree_size(t) == 11
    assert cfx.tree.tree_bytes(t) == 6 * 4 + 5 * 2


def test_allclose_detects_difference_and_structure():
    a = sample()
    b = cfx.tree.map(lambda x: x.clone(), a)
    assert cfx.tree.tree_allclose(a, b)
    b["blocks"][1]["w"] = b["blocks"][1]["w"] + 1e-3
    assert not cfx.tree.tree_allclose(a, b)
    assert not cfx.tree.tree_allclose({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_mismatched_structure_names_the_path():
    with pytest.raises(ValueError, match=r"blocks\.1\.b"):
        cfx.tree.map(lambda x, y: x + y, {"blocks": [{}, {"b": torch.zeros(1)}]},
                     {"blocks": [{}, {"c": torch.zeros(1)}]})
    with pytest.raises(AssertionError, match=r"leaf 'a\.w'"):
        cfx.tree.assert_tree_close({"a": {"w": torch.zeros(2)}}, {"a": {"w": torch.ones(2)}})


def test_leaves_as_reads_a_tree_of_the_given_structure_and_refuses_any_other():
    from cfx._src.core.tree import leaves_as

    t = sample()
    leaves, treedef = cfx.tree.flatten(t)
    got = leaves_as(dict(reversed(list(t.items()))), treedef)  # the same tree, its keys in another order
    assert got is not None and len(got) == len(leaves) and all(a is b for a, b in zip(got, leaves))
    other = sample()
    other["blocks"][1]["b"] = torch.ones(1)  # None (an empty subtree) became a leaf
    extra = sample() | {"more": torch.ones(1)}
    as_tuple = sample() | {"blocks": tuple(t["blocks"])}
    deeper = sample()
    deeper["state"] = State(mu={"x": {"y": torch.ones(1)}}, count=torch.tensor(3))  # a subtree where a leaf was
    number = sample()
    number["state"] = State(mu={"x": 1.0}, count=torch.tensor(3))  # a leaf that is not a tensor
    for bad in (other, extra, as_tuple, deeper, number):
        assert leaves_as(bad, treedef) is None


def test_leaves_as_reads_the_leaves_in_the_structures_order():
    from collections import OrderedDict

    from cfx._src.core.tree import leaves_as

    a, b = torch.zeros(1), torch.ones(1)
    _, treedef = cfx.tree.flatten({"a": a, "b": b})
    assert leaves_as({"b": b, "a": a}, treedef) == [a, b]  # keys looked up, whatever the insertion order
    assert leaves_as(OrderedDict(b=b, a=a), treedef) == [a, b]  # (dict-like types read alike: see its doc)
