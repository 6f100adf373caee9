"""A region (``flow.Region``) turned into a loop over chunks inside the graph.

The region's members leave the graph; a ``ChunkLoop`` submodule takes their place at the region's
output: it allocates the output once, and for each chunk slices its inputs (views), runs the
members on them -- a ``GraphModule`` per chunk length, the view and expand sizes along the chunked
dim set to that length -- and copies the result into the output's slice. The numbers are the
unchunked graph's; only what is alive at once changes.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx import Node
from torch.fx.node import map_arg

from cfx._src.autochunk.estimate import Item, items, simulate
from cfx._src.autochunk.flow import _VIEWS, Chunk, Region

aten = torch.ops.aten
_SIZED = _VIEWS | {aten.expand.default}  # ops whose size argument names the chunked dim's length


class ChunkLoop(torch.nn.Module):
    """The members of ``region`` run ``size`` chunk indices at a time (module doc)."""

    def __init__(self, region: Region, size: int):
        super().__init__()
        self.region, self.size = region, int(size)
        out = region.output.meta["val"]
        self.out_shape, self.out_dtype = tuple(out.shape), out.dtype
        self._modules_by_length: dict[int, fx.GraphModule] = {}
        self.transient = transient(region, self.size)

    @property
    def chunks(self) -> int:
        return -(-self.region.n // self.size)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        r = self.region
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=inputs[0].device if inputs else None)
        for s in range(0, r.n, self.size):
            length = min(self.size, r.n - s)
            parts = [x if c is None else x.narrow(c.dim, s * c.unit, length * c.unit)
                     for x, (_, c) in zip(inputs, r.inputs)]
            got = self._module(length)(*parts)
            out.narrow(r.chunk.dim, s * r.chunk.unit, length * r.chunk.unit).copy_(got)
        return out

    def _module(self, length: int) -> fx.GraphModule:
        if length not in self._modules_by_length:
            self._modules_by_length[length] = _members_module(self.region, length)
        return self._modules_by_length[length]


def _members_module(r: Region, length: int) -> fx.GraphModule:
    g = fx.Graph()
    given = {key: g.placeholder(f"in{i}") for i, key in enumerate(r.inputs)}
    done: dict[Node, Node] = {}
    for node in r.members:
        def arg(a: Node, node=node) -> Node:
            return done[a] if a in done else given[(a, r.needs[node].get(a))]
        args = map_arg(node.args, arg)
        if node.target in _SIZED:  # the chunked dim's size: this chunk's
            c = _chunk_of(r, node)
            sizes = list(args[1])
            sizes[c.dim] = length * c.unit
            args = (args[0], sizes, *args[2:])
        done[node] = g.call_function(node.target, args, map_arg(node.kwargs, arg))
    g.output(done[r.output])
    return fx.GraphModule(torch.nn.Module(), g)


def _chunk_of(r: Region, node: Node) -> Chunk:
    """The chunk of ``node``'s output its users (or the region) take."""
    if node is r.output:
        return r.chunk
    for u in node.users:
        c = r.needs.get(u, {}).get(node)
        if c is not None:
            return c
    raise AssertionError(f"autochunk: member {node} has no chunked user")


def transient(r: Region, size: int) -> int:
    """Bytes the members hold at once for ``size`` chunk indices (their peak, scaled)."""
    members = set(r.members)
    seq = items([*(x for x, _ in r.inputs), *r.members])
    seq = [it for it in seq if it.node in members]
    # the region's inputs arrive as views of their slices: they allocate nothing
    peak = simulate(seq + [_keep(r)]).bytes
    return -(-peak * size // r.n)


def _keep(r: Region) -> Item:
    return Item(r.output, 0, r.output, {r.output})


def apply(gm: fx.GraphModule, r: Region, size: int, name: str) -> fx.GraphModule:
    """A new GraphModule computing ``gm`` with ``r`` run as a ``ChunkLoop`` of ``size``."""
    root = torch.nn.Module()
    for k, v in gm.named_children():
        root.add_module(k, v)
    for k, v in gm.named_buffers(recurse=False):
        root.register_buffer(k, v)
    for k, v in gm.named_parameters(recurse=False):
        root.register_parameter(k, v)
    for k in _attr_constants(gm):
        setattr(root, k, getattr(gm, k))
    loop = ChunkLoop(r, size)
    root.add_module(name, loop)
    members = set(r.members)
    g = fx.Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node in members and node is not r.output:
            continue
        if node is r.output:
            new = g.call_module(name, tuple(env[x] for x, _ in r.inputs))
            new.meta = {"val": node.meta["val"], "autochunk_transient": loop.transient}
        else:
            new = g.node_copy(node, lambda a: env[a])
        env[node] = new
    return fx.GraphModule(root, g)


def _attr_constants(gm: fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and "." not in n.target
            and not isinstance(getattr(gm, n.target, None), torch.nn.Module)]

