"""Activation memory of an aten graph, estimated without running it.

Each op's fresh outputs are allocated when it runs and freed after the last use of them or of any
view of them (the order a ``GraphModule`` frees its values in); views, ``getitem`` and the
function's inputs allocate nothing. The peak is the largest sum of live bytes at any op, plus
what that op holds while it runs (a chunked region's per-chunk intermediates: ``transient``).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

aten = torch.ops.aten
ALIASES = {aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
           aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
           aten.expand.default, aten.select.int, aten.slice.Tensor, aten.alias.default, aten.t.default,
           aten.detach.default, aten.as_strided.default, aten.diagonal.default, aten.reshape.default}


def nbytes(node: Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


@dataclasses.dataclass
class Item:
    """One op: what it allocates (under ``root``), the roots it reads, what it holds while running."""

    node: Node
    alloc: int
    root: Node
    uses: set
    transient: int = 0


def items(order: list) -> list[Item]:
    """The ops of a graph in execution order, with aliasing resolved to storage roots."""
    root: dict[Node, Node] = {}
    out = []
    for node in order:
        ins = {root.get(a, a) for a in node.all_input_nodes}
        if node.op in ("placeholder", "get_attr"):
            root[node] = node
            continue
        if node.op == "output":
            out.append(Item(node, 0, node, ins))
            continue
        if node.target in ALIASES or node.target is operator.getitem:
            src = node.args[0]
            root[node] = root.get(src, src) if isinstance(src, Node) else node
            out.append(Item(node, 0, root[node], ins))
            continue
        root[node] = node
        out.append(Item(node, nbytes(node), node, ins, node.meta.get("autochunk_transient", 0)))
    return out


@dataclasses.dataclass(frozen=True)
class Peak:
    bytes: int
    at: Node | None                  # the op at which it occurs
    live: tuple                      # (root node, bytes) live there, largest first
    profile: tuple = ()              # bytes held at each item of the sequence


def simulate(seq: list[Item]) -> Peak:
    """The peak of ``seq`` (module doc) and the bytes held at each of its items."""
    last: dict[Node, int] = {}
    for i, it in enumerate(seq):
        for r in it.uses:
            last[r] = i
    live: dict[Node, int] = {}
    total = best = 0
    at, snapshot, profile = None, (), []
    for i, it in enumerate(seq):
        if it.alloc:
            live[it.root] = it.alloc
            total += it.alloc
        profile.append(total + it.transient)
        if total + it.transient > best:
            best, at = total + it.transient, it.node
            snapshot = tuple(sorted(live.items(), key=lambda kv: -kv[1]))
        for r in it.uses:
            if last.get(r) == i and r in live:
                total -= live.pop(r)
        if it.alloc and it.root not in last and it.root in live:  # never read (dead): freed at once
            total -= live.pop(it.root)
    return Peak(best, at, snapshot, tuple(profile))
