"""``cfx.init_sharded``: a model's parameters built straight into ShardedArrays.

No process ever holds the whole model: the init function is recorded lazily (``lazy``), then
each leaf is computed alone, sliced into this process's blocks and dropped before the next one.
Peak memory is this process's blocks plus one leaf (and that leaf's temporaries). The blocks
equal ``device_put(init(key), mesh, spec)`` bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from cfx._src.mesh import layout
from cfx._src.spmd import lazy
from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P
from cfx._src.transforms.shapes import eval_shape
from cfx._src.spmd.sharded import ShardedArray
from cfx._src.spmd.spec_tree import broadcast_specs


def init_sharded(init: Callable[..., Any], *args: Any, mesh, specs: Any = P()) -> Any:
    """``init(*args)`` (e.g. ``model.init``, ``key``) as a pytree of ShardedArrays laid out by
    ``specs`` (a pytree prefix of the output, ``P`` leaves) on ``mesh``; see the module doc.

    Specs are checked against the shapes (from ``eval_shape``, nothing allocated) before any
    value is computed: a mismatch is a ValueError naming the leaf, the mesh and the fix.
    """
    shapes = eval_shape(init, *args)
    items = broadcast_specs(specs, shapes, "specs", mesh, where="cfx.init_sharded")
    for path, leaf, spec in items:
        if not hasattr(leaf, "shape"):
            raise ValueError(f"cfx.init_sharded: leaf {path or '<root>'!r} of the init's output is a "
                             f"{type(leaf).__name__}, not a tensor; return only tensors.")
        layout.check_spec(path, leaf.shape, spec, mesh, "cfx.init_sharded")
    recorded = lazy.record(init, *args)
    leaves, treedef = tree_util.flatten(recorded.out)
    # Every block is allocated before any leaf is computed: the leaves' temporaries then never
    # sit between long-lived blocks, so the allocator can reuse and return their memory (with
    # blocks and temporaries interleaved, glibc's heap fragments to several times the blocks).
    blocks = [{r: torch.empty(layout.block_shape(x.shape, spec, mesh), dtype=x.dtype) for r in mesh.local_ranks}
              for x, (_, _, spec) in zip(leaves, items)]
    with torch.no_grad():
        for x, (_, _, spec), own in zip(leaves, items, blocks):
            value = recorded.materialise(x)
            for r, b in own.items():
                b.copy_(layout.block_of(value, spec, mesh, mesh.coords(r)))
            del value
    return tree_util.unflatten(treedef, [ShardedArray(tuple(x.shape), spec, mesh, own)
                                         for x, (_, _, spec), own in zip(leaves, items, blocks)])

