"""Building a ``GeminiEngine``: its layout (``setup``) and its chunks (``fill``), from this rank's
pieces or from ``init(key)`` one leaf at a time (``from_init``).

Each piece is copied straight to its place in its chunk; a chunk is stored at its home as soon as
all its leaves have arrived (params, the fp32 master in low precision, and each slice's optimizer
state), so what is held at once is the chunks still being filled and one leaf -- not the model.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Future

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.placer import Placer
from cfx._src.gemini.policy import AutoPolicy, DevicePolicy
from cfx._src.gemini.states import TensorState as S
from cfx._src.lax import collectives as lax
from cfx._src.mesh import memory
from cfx._src.zero.chunk_stores import ChunkStores
from cfx._src.zero.chunking import check_budget, pack_groups
from cfx._src.zero.flat import GroupLayout, piece_of, piece_size
from cfx._src.zero.offload import ChunkRef, Offload, gather_groups


def setup(engine, model, items, treedef, shapes, n, tx, *, axis, offload, max_chunk_size, slice_bytes) -> None:
    """``engine``'s layout for leaves ``items`` (paths and pieces, or ShapeDtypes): its groups, chunking,
    stores and placer; nothing stored yet."""
    if not isinstance(offload, Offload):
        raise ValueError("GeminiEngine: pass offload=cfx.zero.offload(cfx.gemini.host(), ...).")
    engine.tx, engine.axis, engine.cfg, engine.n, engine.treedef = tx, axis, offload, n, treedef
    engine.paths, engine.shapes = [p for p, _ in items], tuple(shapes)
    engine.groups = gather_groups(model, engine.paths)
    engine.layouts = [GroupLayout(tuple(engine.paths[i] for i in g), tuple(engine.shapes[i] for i in g), engine.n)
                      for g in engine.groups]
    dtypes = {items[g[0]][1].dtype for g in engine.groups}
    if len(dtypes) > 1:
        raise ValueError(f"GeminiEngine: chunks are flat buffers of one dtype; the params mix {sorted(map(str, dtypes))}.")
    engine.dtype = dtypes.pop()
    engine.chunks = pack_groups([lay.size for lay in engine.layouts], max_size=max_chunk_size)
    engine.chunk_search = engine.chunks.search
    engine.chunk_bytes = [engine.chunks.size * engine.dtype.itemsize] * engine.chunks.n_chunks
    if isinstance(offload.policy, AutoPolicy):  # before any store or collective, on every rank
        check_budget(engine.chunks, engine.dtype.itemsize, engine.n, offload.policy.device_budget_bytes,
                     [engine.paths[engine.groups[gs[0]][0]] for gs in engine.chunks.groups])
    nvme = offload.nvme_dir and os.path.join(offload.nvme_dir, f"rank{lax.axis_index(axis)}-{id(engine):x}")
    engine.tiers = ChunkStores(offload, nvme_dir=nvme, size=engine.chunks.size,
                               slice_bytes=slice_bytes)  # params, state and grads
    engine.stores, engine.traffic = engine.tiers.stores, engine.tiers.traffic
    engine.files = engine.tiers.io is not None
    engine.refs = [ChunkRef(engine, g) for g in range(len(engine.groups))]
    engine.states = {g: S.FREE for g in range(len(engine.groups))}  # per group (layer)
    engine.placer = Placer(offload.policy, engine.chunk_bytes, fetch=engine._fetch, evict=engine._evict)
    engine.anchor: torch.Tensor | None = None
    engine._order: list[int] = []        # files: the chunks of the last backward's accesses, in order
    engine._seen: list[int] = []         # ... and of this one's
    engine._ahead: dict[int, Future] = {}  # files: chunk reads started ahead of their access
    engine._arrived: dict[int, set] = {}   # files: per chunk, the groups whose gradient arrived
    engine._norms: dict[tuple[int, int], tuple] = {}  # files: per (chunk, slice), its gradient's (sq, bad)


def from_init(engine, model, init, key, tx, *, axis: str, offload, max_chunk_size, slice_bytes) -> None:
    """``engine`` (a bare ``GeminiEngine``) set up for ``init(key)``'s params and filled leaf by leaf
    (``cfx.init_sharded``'s lazy record: each leaf computed alone, cut to this rank's piece)."""
    from cfx._src.spmd import lazy
    from cfx._src.transforms.shapes import eval_shape
    shapes = eval_shape(init, key)
    items, treedef = tree_util.flatten_with_path(shapes)
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    for path, x in items:
        if not x.dtype.is_floating_point:
            raise ValueError(f"GeminiEngine.from_init: leaf {path or '<root>'!r} is {x.dtype}; ZeRO shards "
                             "floating-point tensors only. Keep other values out of the params.")
    setup(engine, model, items, treedef, tuple(tuple(x.shape) for _, x in items), n, tx, axis=axis,
                  offload=offload, max_chunk_size=max_chunk_size, slice_bytes=slice_bytes)
    recorded = lazy.record(init, key)
    leaves = tree_util.leaves(recorded.out)

    def pieces():
        with torch.no_grad():
            for i, x in enumerate(leaves):
                value = recorded.materialise(x).reshape(-1)
                yield i, value if n == 1 else piece_of(value, piece_size(value.numel(), n), r)
                del value
    fill(engine, pieces())


def fill(engine, pieces) -> None:
    """``engine``'s chunks packed from ``pieces`` (``(leaf index, this rank's piece)``, in any order), each
    piece copied straight to its place, and stored at its home as soon as all its leaves have
    arrived: params, fp32 master (low precision) and the optimizer state of each slice."""
    where = {}  # leaf -> (chunk, offset in the chunk)
    for g, idx in enumerate(engine.groups):
        at = engine.chunks.offset[g]
        for i in idx:
            where[i] = (engine.chunks.chunk_of[g], at)
            at += piece_size(math.prod(engine.shapes[i]), engine.n)
    filled: dict[int, torch.Tensor] = {}
    left = {c: {i for g in gs for i in engine.groups[g]} for c, gs in enumerate(engine.chunks.groups)}
    with torch.no_grad():
        for i, piece in pieces:
            c, at = where[i]
            if c not in filled:
                with memory.ops_unwatched():
                    filled[c] = torch.zeros(engine.chunks.size, dtype=engine.dtype)
            filled[c][at:at + piece.numel()].copy_(piece.reshape(-1))
            del piece
            left[c].discard(i)
            if not left[c]:
                store_chunk(engine, c, filled.pop(c))
    if engine.files:
        engine.tiers.io.drain()
    if isinstance(engine.cfg.policy, DevicePolicy):
        for c in range(engine.chunks.n_chunks):
            engine.placer.fetch(c)

def store_chunk(engine, c: int, chunk: torch.Tensor) -> None:
    engine.tiers.put_chunk(engine.cfg.param_home, "param", c, chunk)
    low = engine.dtype != torch.float32
    for s in range(engine.tiers.n_slices):
        a, b = engine.tiers.bounds(s)
        master = chunk[a:b].to(torch.float32, copy=True) if low else chunk[a:b]
        if low:
            engine.tiers.put(engine.cfg.optim_home, ("master", c, s), master, "optim")
        engine.tiers.put_inner(c, s, engine.tx.init((master,)))
