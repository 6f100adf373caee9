"""``GeminiEngine``: ZeRO-3 training on one rank with chunks placed by a Gemini policy.

Built inside ``shard_map`` (one per rank: it owns that rank's stores), from the gathered model,
this rank's ``ZeroParams``, an optimizer and an ``Offload`` (``offload``)::

    engine = cfx.zero.GeminiEngine(zmodel, zparams, tx, axis="data", offload=cfx.zero.offload(
        cfx.gemini.auto(512 << 20)))
    loss = engine.step(lambda p: zmodel.loss(p, tokens, targets))   # backward() + update()
    zparams = engine.params()

It is the one stateful object of ZeRO: params, gradients and optimizer state live in its tier
stores (``chunk_stores``), not in pytrees. The gathered layers' shards are packed in execution order into
equal-size flat *chunks* (``chunking``; the size search, over sizes up to ``max_chunk_size``
elements, default twice the largest layer shard, is ``engine.chunk_search``): the unit of
placement, fetch/evict and optimizer step; grads and optimizer state are chunked alike.
``backward(fn)`` runs ``fn`` on a params tree whose leaves point at the chunks: each gathered
layer asks for its group's shard (an *access* of its chunk), which applies the policy's evictions
and fetches (``gemini.placer``), then gathers that slice of the chunk; the backward's reduce-scatter adds the gradient shard into the chunk's gradient
(accumulated over calls: micro-batches). ``update()`` runs ``tx`` chunk by chunk where the
optimizer state lives, inside ``cfx.optim.sharded`` with the rest of the model's sum of squares
and inf/nan count (one all-reduce per step), so global norms and the loss scaler see every
chunk of every rank. Each group's tensor state follows ``cfx.gemini.states``' checked transitions.

With elementwise optimizers (sgd, adam, adamw; no global-norm clipping) the result is bit for bit
that of ``cfx.zero(tx, stage=3)`` on fp32 params, whatever the policy.

With ``nvme_dir`` (``offload(..., nvme_dir=)``) the engine streams a model larger than memory: params,
master weights and moments live in files in slices (``chunk_stores``); a chunk's gradient is
accumulated in host memory only until every group of the chunk has delivered, then written to
its files (with its sum of squares and non-finite count, so the step needs no second pass for the
global norm); from the second step on, the next chunk of the recorded access order is read while
this one computes; ``update`` streams each chunk slice by slice (the next slice's params,
gradient and moments read while this one steps, the stepped ones written behind). ``from_init``
builds the engine from ``init(key)`` one leaf at a time, so no process ever holds the whole model.
``io`` reports the bytes and seconds of file reads and writes.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Future

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.placer import Placer
from cfx._src.gemini.policy import AutoPolicy, DevicePolicy, WarmupRecord
from cfx._src.gemini.states import TensorState as S, transition
from cfx._src.lax import collectives as lax
from cfx._src.mesh import memory
from cfx._src.zero.chunk_stores import SLICE_BYTES, ChunkStores, value_of
from cfx._src.zero.chunking import check_budget, pack_groups
from cfx._src.zero.flat import GroupLayout, piece_of, piece_size
from cfx._src.zero.offload import ChunkRef, Offload, gather_groups
from cfx._src.optim import reduction
from cfx._src.zero.params import ShardedLeaf, ZeroParams, check_axis_size


NO_LEAF_NORMS = ("cfx.zero.GeminiEngine steps flat chunks that pack many leaves; train with "
                 "cfx.parallel.Plan(zero=3, offload=...) instead, whose optimizer sees each leaf's pieces")


class GeminiEngine:
    """See the module doc."""

    def __init__(self, model, zparams: ZeroParams, tx, *, axis: str, offload: Offload,
                 max_chunk_size: int | None = None, slice_bytes: int = SLICE_BYTES):
        if not isinstance(zparams, ZeroParams):
            raise ValueError(f"GeminiEngine: params must be ZeroParams, got {type(zparams).__name__}; make "
                             f"them with cfx.zero.shard_params(params, axis={axis!r}) inside shard_map.")
        check_axis_size(zparams, axis, "GeminiEngine")
        items, treedef = tree_util.flatten_with_path(zparams.pieces)
        self._setup(model, items, treedef, zparams.shapes, zparams.n, tx, axis=axis, offload=offload,
                    max_chunk_size=max_chunk_size, slice_bytes=slice_bytes)
        self._fill(enumerate(x.detach() for _, x in items))

    @classmethod
    def from_init(cls, model, init, key, tx, *, axis: str, offload: Offload, max_chunk_size: int | None = None,
                  slice_bytes: int = SLICE_BYTES) -> "GeminiEngine":
        """Inside ``shard_map``: the engine of ``init(key)``'s params (e.g. ``plain_model.init``; the
        same values as ``GeminiEngine(model, cfx.zero.shard_params(init(key), axis=axis), ...)``), each
        leaf computed alone (``cfx.init_sharded``'s lazy record), cut to this rank's piece and packed
        into its chunk, each chunk written to its tier as soon as it is full: peak memory is one leaf
        and the chunks still being filled, not the model."""
        from cfx._src.spmd import lazy
        from cfx._src.transforms.shapes import eval_shape
        shapes = eval_shape(init, key)
        items, treedef = tree_util.flatten_with_path(shapes)
        n, r = lax.axis_size(axis), lax.axis_index(axis)
        for path, x in items:
            if not x.dtype.is_floating_point:
                raise ValueError(f"GeminiEngine.from_init: leaf {path or '<root>'!r} is {x.dtype}; ZeRO shards "
                                 "floating-point tensors only. Keep other values out of the params.")
        self = cls.__new__(cls)
        self._setup(model, items, treedef, tuple(tuple(x.shape) for _, x in items), n, tx, axis=axis,
                    offload=offload, max_chunk_size=max_chunk_size, slice_bytes=slice_bytes)
        recorded = lazy.record(init, key)
        leaves = tree_util.leaves(recorded.out)

        def pieces():
            with torch.no_grad():
                for i, x in enumerate(leaves):
                    value = recorded.materialise(x).reshape(-1)
                    yield i, value if n == 1 else piece_of(value, piece_size(value.numel(), n), r)
                    del value
        self._fill(pieces())
        return self

    def _setup(self, model, items, treedef, shapes, n, tx, *, axis, offload, max_chunk_size, slice_bytes) -> None:
        if not isinstance(offload, Offload):
            raise ValueError("GeminiEngine: pass offload=cfx.zero.offload(cfx.gemini.host(), ...).")
        self.tx, self.axis, self.cfg, self.n, self.treedef = tx, axis, offload, n, treedef
        self.paths, self.shapes = [p for p, _ in items], tuple(shapes)
        self.groups = gather_groups(model, self.paths)
        self.layouts = [GroupLayout(tuple(self.paths[i] for i in g), tuple(self.shapes[i] for i in g), self.n)
                        for g in self.groups]
        dtypes = {items[g[0]][1].dtype for g in self.groups}
        if len(dtypes) > 1:
            raise ValueError(f"GeminiEngine: chunks are flat buffers of one dtype; the params mix {sorted(map(str, dtypes))}.")
        self.dtype = dtypes.pop()
        self.chunks = pack_groups([lay.size for lay in self.layouts], max_size=max_chunk_size)
        self.chunk_search = self.chunks.search
        self.chunk_bytes = [self.chunks.size * self.dtype.itemsize] * self.chunks.n_chunks
        if isinstance(offload.policy, AutoPolicy):  # before any store or collective, on every rank
            check_budget(self.chunks, self.dtype.itemsize, self.n, offload.policy.device_budget_bytes,
                         [self.paths[self.groups[gs[0]][0]] for gs in self.chunks.groups])
        nvme = offload.nvme_dir and os.path.join(offload.nvme_dir, f"rank{lax.axis_index(axis)}-{id(self):x}")
        self.tiers = ChunkStores(offload, nvme_dir=nvme, size=self.chunks.size,
                                 slice_bytes=slice_bytes)  # params, state and grads
        self.stores, self.traffic = self.tiers.stores, self.tiers.traffic
        self.files = self.tiers.io is not None
        self.refs = [ChunkRef(self, g) for g in range(len(self.groups))]
        self.states = {g: S.FREE for g in range(len(self.groups))}  # per group (layer)
        self.placer = Placer(offload.policy, self.chunk_bytes, fetch=self._fetch, evict=self._evict)
        self.anchor: torch.Tensor | None = None
        self._order: list[int] = []        # files: the chunks of the last backward's accesses, in order
        self._seen: list[int] = []         # ... and of this one's
        self._ahead: dict[int, Future] = {}  # files: chunk reads started ahead of their access
        self._arrived: dict[int, set] = {}   # files: per chunk, the groups whose gradient arrived
        self._norms: dict[tuple[int, int], tuple] = {}  # files: per (chunk, slice), its gradient's (sq, bad)

    def _fill(self, pieces) -> None:
        """Every chunk packed from ``pieces`` (``(leaf index, this rank's piece)``, in any order), each
        piece copied straight to its place, and stored at its home as soon as all its leaves have
        arrived: params, fp32 master (low precision) and the optimizer state of each slice."""
        where = {}  # leaf -> (chunk, offset in the chunk)
        for g, idx in enumerate(self.groups):
            at = self.chunks.offset[g]
            for i in idx:
                where[i] = (self.chunks.chunk_of[g], at)
                at += piece_size(math.prod(self.shapes[i]), self.n)
        filled: dict[int, torch.Tensor] = {}
        left = {c: {i for g in gs for i in self.groups[g]} for c, gs in enumerate(self.chunks.groups)}
        with torch.no_grad():
            for i, piece in pieces:
                c, at = where[i]
                if c not in filled:
                    with memory.ops_unwatched():
                        filled[c] = torch.zeros(self.chunks.size, dtype=self.dtype)
                filled[c][at:at + piece.numel()].copy_(piece.reshape(-1))
                del piece
                left[c].discard(i)
                if not left[c]:
                    self._store_chunk(c, filled.pop(c))
        if self.files:
            self.tiers.io.drain()
        if isinstance(self.cfg.policy, DevicePolicy):
            for c in range(self.chunks.n_chunks):
                self.placer.fetch(c)

    def _store_chunk(self, c: int, chunk: torch.Tensor) -> None:
        self.tiers.put_chunk(self.cfg.param_home, "param", c, chunk)
        low = self.dtype != torch.float32
        for s in range(self.tiers.n_slices):
            a, b = self.tiers.bounds(s)
            master = chunk[a:b].to(torch.float32, copy=True) if low else chunk[a:b]
            if low:
                self.tiers.put(self.cfg.optim_home, ("master", c, s), master, "optim")
            self.tiers.put_inner(c, s, self.tx.init((master,)))

    @property
    def record(self) -> WarmupRecord | None:
        """``auto``'s warm-up measurement (None before the first step)."""
        return self.placer.record

    @property
    def resident(self) -> set[int]:
        """The chunks on the device."""
        return self.placer.resident

    # -- placement -----------------------------------------------------------------------------
    def _device_shard(self, g) -> torch.Tensor:
        """Group ``g``'s shard: a view into the device copy of its chunk."""
        c = self.chunks.chunk_of[g]
        key = ("param", c, 0) if self.cfg.param_home == "device" else ("copy", c)
        return self.chunks.view(self.stores["device"].get(key), g)

    def _fetch(self, c) -> None:
        if self.cfg.param_home == "device":
            return
        ahead = self._ahead.pop(c, None)
        x = ahead.result() if ahead is not None else self.tiers.get_chunk(self.cfg.param_home, "param", c)
        if self.files:
            self.stores["device"].adopt(("copy", c), x, kind="chunk")  # read for this copy: no second one
        else:
            self.stores["device"].put(("copy", c), x, kind="chunk")
        self.traffic["host->device"] += self.chunk_bytes[c]

    def _read_ahead(self, c: int) -> None:
        """Files: start reading the chunk the recorded order accesses after this access of ``c``."""
        t = len(self._seen)
        self._seen.append(c)
        nxt = next((d for d in self._order[t + 1:] if d != c), None) if t < len(self._order) and \
            self._order[t] == c else None
        if nxt is not None and nxt not in self.placer.resident and nxt not in self._ahead:
            self._ahead[nxt] = self.tiers.chunk_async(self.cfg.param_home, "param", nxt)

    def _evict(self, c) -> None:
        if self.cfg.param_home != "device":
            self.stores["device"].delete(("copy", c))  # a clean cache copy: nothing to write back

    # -- called by the gathered layers (through ChunkSource) ------------------------------------
    def check_layout(self, g, layout: GroupLayout, axis: str) -> None:
        ref = self.layouts[g]
        if axis != self.axis or layout.shapes != ref.shapes or layout.n != ref.n:
            raise ValueError(f"GeminiEngine: gathered layer over {axis!r} with leaf shapes {layout.shapes[:3]}... "
                             f"does not match group {g} ({ref.paths[:3]}...) of this engine over {self.axis!r}; "
                             "build the engine from the same gathered model.")

    def _move(self, g, *targets) -> None:
        for s in targets:
            self.states[g] = transition(self.states[g], s, what=f"group {g} ({self.layouts[g].paths[0]}...)")

    def acquire(self, g: int, *, backward: bool) -> torch.Tensor:
        """Group ``g``'s shard on the device, after the policy's moves for this access of its chunk."""
        self.placer.access(self.chunks.chunk_of[g])
        if self.files:
            self._read_ahead(self.chunks.chunk_of[g])
        if backward and self.states[g] is S.HOLD_AFTER_FWD:
            self._move(g, S.FREE)
        self._move(g, S.HOLD)
        return self._device_shard(g)

    def computing(self, g: int) -> None:
        self._move(g, S.COMPUTE)

    def forward_done(self, g: int) -> None:
        self._move(g, S.HOLD_AFTER_FWD, S.FREE)

    def add_grad(self, g: int, grad: torch.Tensor) -> None:
        """Add group ``g``'s reduce-scattered gradient shard into its slice of its chunk's gradient."""
        if self.states[g] is S.COMPUTE:  # re-gathered in backward
            self._move(g, S.HOLD_AFTER_BWD, S.HOLD, S.FREE)
        c = self.chunks.chunk_of[g]
        chunk = self.tiers.grad_chunk(c, grad)
        self.chunks.view(chunk, g).add_(grad)
        if self.files:
            arrived = self._arrived.setdefault(c, set())
            arrived.add(g)
            if len(arrived) == len(self.chunks.groups[c]):  # the chunk's gradient is whole: to its files
                self._flush_grad(c)

    def _flush_grad(self, c: int) -> None:
        self._arrived.pop(c, None)
        for s, norms in enumerate(self.tiers.flush_grad(c)):
            self._norms[(c, s)] = norms

    # -- training ------------------------------------------------------------------------------
    def tree(self):
        """The params-shaped tree of ``ShardedLeaf``s pointing at the chunks (what ``fn`` gets)."""
        leaves = [None] * len(self.paths)
        for g, idx in enumerate(self.groups):
            for i in idx:
                leaves[i] = ShardedLeaf(None, self.shapes[i], self.n, self.refs[g])
        return tree_util.unflatten(self.treedef, leaves)

    def backward(self, fn, *args, **kwargs) -> torch.Tensor:
        """``fn(params_tree, *args, **kwargs)`` (a scalar loss) and its backward; accumulates grads."""
        self.anchor = torch.zeros((), requires_grad=True)
        self._seen = []
        try:
            with self.placer.step(agree=lambda v: lax.pmax(v, self.axis)):
                loss = fn(self.tree(), *args, **kwargs)
                torch.autograd.backward(loss, inputs=[self.anchor])
        finally:
            self.anchor = None
            for fut in self._ahead.values():  # read ahead, never accessed
                fut.result()
            self._ahead.clear()
        if self.files:
            self._order = self._seen
            for c in self.tiers.in_memory_grads():  # chunks some of whose groups got no gradient
                self._flush_grad(c)
        return loss.detach()

    def update(self) -> None:
        """One optimizer step over every chunk, then drop the gradients."""
        units = [(c, s) for c in range(self.chunks.n_chunks) for s in range(self.tiers.n_slices)]
        with torch.no_grad():
            if self.files:
                zero = torch.zeros(())
                norms = [self._norms.get(u, (zero, zero)) for u in units]
                grads = None
            else:
                grads = [self.tiers.take_grad(c) for c in range(self.chunks.n_chunks)]
                norms = [(g.pow(2).sum(), (~torch.isfinite(g)).sum().to(torch.float32)) for g in grads]
            # one all-reduce for the whole model's norm and inf/nan count; each unit is stepped
            # inside cfx.optim.sharded with the rest of them, so clipping and the loss scaler
            # see every chunk of every rank
            sq, bad = [n[0] for n in norms], [n[1] for n in norms]
            total = lax.psum(torch.stack([sum(sq), sum(bad)]), self.axis)
            ahead = self._read_unit(*units[0]) if self.files else None
            for k, (c, s) in enumerate(units):
                got = ahead
                if self.files and k + 1 < len(units):
                    ahead = self._read_unit(*units[k + 1])  # the next slice read while this one steps
                with reduction.sharded([()], every=(), psum=lax.psum, rest_sq=(total[0] - sq[k]).clamp_min(0.0),
                                       rest_bad=total[1] - bad[k], no_leaf_norms=NO_LEAF_NORMS):
                    self._update_unit(c, s, got if self.files else self._memory_unit(c, grads[c]))
            self._norms.clear()
            if self.files:
                self.tiers.io.drain()  # the step's state is in its files before the step returns
        for c in sorted(self.resident):
            if isinstance(self.cfg.policy, DevicePolicy):
                if self.cfg.param_home != "device":
                    self.stores["device"].get(("copy", c)).copy_(self.tiers.get_chunk(self.cfg.param_home, "param", c))
                    self.traffic["host->device"] += self.chunk_bytes[c]
            else:
                self.placer.evict(c)

    def _read_unit(self, c: int, s: int) -> dict:
        """Slice ``s`` of chunk ``c`` from the files: params, gradient (zeros where none arrived),
        master (low precision) and optimizer state, read on the I/O thread."""
        home, ohome = self.cfg.param_home, self.cfg.optim_home
        got = {"param": self.tiers.read_async(home, ("param", c, s)), "inner": self.tiers.inner_async(c, s)}
        if self.tiers.has_file(("grad", c, s)):
            got["grad"] = self.tiers.read_async("nvme", ("grad", c, s))
        if self.dtype != torch.float32:
            got["master"] = self.tiers.read_async(ohome, ("master", c, s))
        return got

    def _memory_unit(self, c: int, grad: torch.Tensor) -> dict:
        home, ohome = self.cfg.param_home, self.cfg.optim_home
        got = {"param": self.tiers.get(home, ("param", c, 0)), "inner": self.tiers.inner_async(c, 0), "grad": grad}
        if self.dtype != torch.float32:
            got["master"] = self.tiers.get(ohome, ("master", c, 0))
        return got

    def _update_unit(self, c: int, s: int, got: dict) -> None:
        home, ohome = self.cfg.param_home, self.cfg.optim_home
        p = value_of(got["param"], self.tiers, home)
        a, b = self.tiers.bounds(s)
        g = value_of(got["grad"], self.tiers, "nvme") if "grad" in got else torch.zeros(b - a, dtype=torch.float32)
        if self.files and "grad" in got:
            self.tiers.delete_file(("grad", c, s))
        low = self.dtype != torch.float32
        master = value_of(got["master"], self.tiers, ohome) if low else p
        (u,), inner = self.tx.update((g,), self.tiers.inner_of(got["inner"]), (master,))
        if low:
            new_master = master + u
            self.tiers.write(ohome, ("master", c, s), new_master, "optim")
            new_p = new_master.to(self.dtype)
        else:
            new_p = p + u
        self.tiers.write(home, ("param", c, s), new_p, "param")
        self.tiers.write_inner(c, s, inner)

    @property
    def io(self) -> dict:
        """Files: bytes read and written and the seconds spent in those calls, so far (zeros without files)."""
        store = self.stores.get("nvme")
        return dict(store.io) if store is not None else {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0}

    def step(self, fn, *args, **kwargs) -> torch.Tensor:
        loss = self.backward(fn, *args, **kwargs)
        self.update()
        return loss

    def params(self) -> ZeroParams:
        """This rank's pieces (fresh tensors), as ``ZeroParams``."""
        leaves = [None] * len(self.paths)
        for c, gs in enumerate(self.chunks.groups):
            chunk = self.tiers.get_chunk(self.cfg.param_home, "param", c)
            for g in gs:
                for i, piece in zip(self.groups[g], self.layouts[g].split_shard(self.chunks.view(chunk, g))):
                    leaves[i] = piece.clone()
        return ZeroParams(tree_util.unflatten(self.treedef, leaves), self.shapes, self.n)

    def close(self) -> None:
        """Drop every chunk, gradient and optimizer state from the stores (NVMe files and the
        engine's NVMe directory included; an engine that is garbage collected does the same)."""
        self.tiers.close()
        self.placer.resident.clear()

    def inner_state(self, c: int = 0):
        """The optimizer state of chunk ``c`` (e.g. to read a loss scale: every chunk's is the same)."""
        return self.tiers.load_inner(c, 0)

