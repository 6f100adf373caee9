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

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.policy import DevicePolicy, WarmupRecord
from cfx._src.gemini.states import TensorState as S, transition
from cfx._src.lax import collectives as lax
from cfx._src.zero import engine_build as build, engine_update
from cfx._src.zero.chunk_stores import SLICE_BYTES
from cfx._src.zero.flat import GroupLayout
from cfx._src.zero.offload import Offload
from cfx._src.zero.params import ShardedLeaf, ZeroParams, check_axis_size


class GeminiEngine:
    """See the module doc."""

    def __init__(self, model, zparams: ZeroParams, tx, *, axis: str, offload: Offload,
                 max_chunk_size: int | None = None, slice_bytes: int = SLICE_BYTES):
        if not isinstance(zparams, ZeroParams):
            raise ValueError(f"GeminiEngine: params must be ZeroParams, got {type(zparams).__name__}; make "
                             f"them with cfx.zero.shard_params(params, axis={axis!r}) inside shard_map.")
        check_axis_size(zparams, axis, "GeminiEngine")
        items, treedef = tree_util.flatten_with_path(zparams.pieces)
        build.setup(self, model, items, treedef, zparams.shapes, zparams.n, tx, axis=axis, offload=offload,
                    max_chunk_size=max_chunk_size, slice_bytes=slice_bytes)
        build.fill(self, enumerate(x.detach() for _, x in items))

    @classmethod
    def from_init(cls, model, init, key, tx, *, axis: str, offload: Offload, max_chunk_size: int | None = None,
                  slice_bytes: int = SLICE_BYTES) -> "GeminiEngine":
        """Inside ``shard_map``: the engine of ``init(key)``'s params (e.g. ``plain_model.init``; the
        same values as ``GeminiEngine(model, cfx.zero.shard_params(init(key), axis=axis), ...)``), each
        leaf computed alone (``cfx.init_sharded``'s lazy record), cut to this rank's piece and packed
        into its chunk, each chunk written to its tier as soon as it is full: peak memory is one leaf
        and the chunks still being filled, not the model."""
        self = cls.__new__(cls)
        build.from_init(self, model, init, key, tx, axis=axis, offload=offload, max_chunk_size=max_chunk_size,
                        slice_bytes=slice_bytes)
        return self

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
        x = self.tiers.chunk_value(ahead) if ahead is not None else self.tiers.get_chunk(self.cfg.param_home, "param", c)
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
        """One optimizer step over every chunk (``engine_update``), then drop the gradients."""
        engine_update.update(self)
        for c in sorted(self.resident):
            if isinstance(self.cfg.policy, DevicePolicy):
                if self.cfg.param_home != "device":
                    self.stores["device"].get(("copy", c)).copy_(self.tiers.get_chunk(self.cfg.param_home, "param", c))
                    self.traffic["host->device"] += self.chunk_bytes[c]
            else:
                self.placer.evict(c)

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

