"""Choosing regions and chunk sizes until the estimated peak fits a budget.

Greedy, one region per round: at the current peak, the largest live tensors' producers are what
must shrink. Every region that ends at a non-view op up to ``window`` ops after such a producer,
chunked along any dim of its output, and that contains the producer (``flow``) is a candidate; for
each, the chunk size is the largest that brings the whole graph's estimated peak to the budget or,
when other ops keep it above, to the lowest this region can reach (more chunks would only cost
time). The candidate with the lowest peak wins, the fewest chunk launches (chunks x ops) breaking
ties and choosing among those that fit. Rounds stop when the estimate fits, or fail when no
candidate lowers it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx
from torch.fx import Node

from cfx._src.autochunk.estimate import ALIASES, Item, Peak, items, nbytes, simulate
from cfx._src.autochunk.flow import Chunk, Region, flow, shape_of
from cfx._src.autochunk.rewrite import apply, transient
from cfx._src.core.text import format_bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    """One chunked region: its output op, the dim and its length, indices per chunk, the ops run
    per chunk, and the estimated peak once it is chunked."""

    output: str
    op: str
    dim: int
    length: int
    size: int
    ops: int
    peak: int

    @property
    def chunks(self) -> int:
        return -(-self.length // self.size)


def search(gm: fx.GraphModule, budget: int, *, window: int = 48, top: int = 3, max_rounds: int = 512,
           progress: Callable[[int, int], None] | None = None) -> tuple[fx.GraphModule, list[Choice], int, int]:
    """``(chunked graph, choices, estimated peak before, after)`` for ``budget`` bytes."""
    before = simulate(items(list(gm.graph.nodes)))
    peak, choices = before, []
    for k in range(max_rounds):
        if peak.bytes <= budget:
            break
        if progress is not None:
            progress(k, peak.bytes)
        best = _best(gm, peak, budget, window, top)
        if best is None:  # nothing at the peak lowers what it holds
            raise ValueError(_cannot(budget, peak, choices))
        region, size = best
        gm = apply(gm, region, size, f"chunk{k}")
        peak = simulate(items(list(gm.graph.nodes)))
        choices.append(Choice(region.output.name, _op_name(region.output), region.chunk.dim, region.n, size,
                              len(region.members), peak.bytes))
    else:
        raise ValueError(_cannot(budget, peak, choices))
    return gm, choices, before.bytes, peak.bytes


def _best(gm: fx.GraphModule, peak: Peak, budget: int, window: int, top: int):
    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    seq = items(order)
    root = {it.node: it.root for it in seq}
    producers = [r for r, _ in peak.live if r.op == "call_function"][:top]
    best, seen = None, set()
    for u in producers:
        for o in _after(order, index, u, window):
            if o.target in ALIASES or shape_of(o) is None or nbytes(o) > nbytes(u):
                continue
            for d, length in enumerate(shape_of(o)):
                if length < 2 or (o, d) in seen:
                    continue
                seen.add((o, d))
                region = flow(order, index, o, Chunk(d))
                if region is None or u not in region.members:
                    continue
                before, after, size, launches = _sized(seq, root, region, budget)
                if after >= before:
                    continue
                key = (after > budget, after if after > budget else 0, launches)
                if best is None or key < best[0]:
                    best = (key, region, size)
    return None if best is None else best[1:]


def _after(order: list, index: dict, u: Node, window: int) -> list[Node]:
    """``u`` and the ops up to ``window`` after it that depend on it."""
    reach, out = {u}, [u]
    for node in order[index[u] + 1:index[u] + 1 + window]:
        if any(a in reach for a in node.all_input_nodes):
            reach.add(node)
            if node.op == "call_function":
                out.append(node)
    return out


def _sized(seq: list[Item], root: dict, r: Region, budget: int) -> tuple[int, int, int, int]:
    """``(held before, held after, indices per chunk, launches)`` over the ops from the region's
    first member to its output, for the best size of region ``r``: the largest that brings them to
    the budget, or to the lowest the region reaches."""
    full = transient(r, r.n)
    members = set(r.members)
    uses = {root.get(x, x) for x, _ in r.inputs}
    o = r.output
    first = next(i for i, it in enumerate(seq) if it.node in members)
    last = next(i for i, it in enumerate(seq) if it.node is o)
    before = max(simulate(seq).profile[first:last + 1])

    def held(size: int) -> int:
        out, lo = [], None
        for i, it in enumerate(seq):
            if i == first:
                lo = len(out)
            if it.node is o:
                out.append(Item(o, nbytes(o), o, uses, -(-full * size // r.n)))
                hi = len(out)
            elif it.node not in members:
                out.append(it)
        return max(simulate(out).profile[lo:hi])
    sizes = sorted({-(-r.n // k) for k in range(2, r.n + 1)}, reverse=True)  # fewest chunks first
    target = max(budget, held(1))
    lo, hi = 0, len(sizes) - 1  # sizes[-1] == 1 reaches the target; find the largest size that does
    while lo < hi:
        mid = (lo + hi) // 2
        if held(sizes[mid]) <= target:
            hi = mid
        else:
            lo = mid + 1
    size = sizes[lo]
    return before, held(size), size, -(-r.n // size) * len(r.members)


def _op_name(node: Node) -> str:
    return str(getattr(node.target, "__name__", node.target)).replace(".default", "")


def _cannot(budget: int, peak: Peak, choices: list) -> str:
    biggest = ", ".join(f"{r.name} ({format_bytes(b)})" for r, b in peak.live[:3])
    return (f"cfx.autochunk: no chunking fits memory_budget={format_bytes(budget)}: after {len(choices)} chunked "
            f"region(s) the estimated peak is {format_bytes(peak.bytes)} at {peak.at.name if peak.at else '?'}, "
            f"where the largest live tensors are {biggest}, which no op along them can split further. Raise the "
            "budget, or split the inputs yourself (e.g. a smaller batch).")
