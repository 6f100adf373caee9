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
"""
from __future__ import annotations

import os

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.placer import Placer
from cfx._src.gemini.policy import AutoPolicy, DevicePolicy, WarmupRecord
from cfx._src.gemini.states import TensorState as S, transition
from cfx._src.lax import collectives as lax
from cfx._src.zero.chunk_stores import ChunkStores
from cfx._src.zero.chunking import check_budget, pack_groups
from cfx._src.zero.flat import GroupLayout, concat_flat
from cfx._src.zero.offload import ChunkRef, Offload, gather_groups
from cfx._src.optim import reduction
from cfx._src.zero.params import ShardedLeaf, ZeroParams, check_axis_size


NO_LEAF_NORMS = ("cfx.zero.GeminiEngine steps flat chunks that pack many leaves; train with "
                 "cfx.parallel.Plan(zero=3, offload=...) instead, whose optimizer sees each leaf's pieces")


class GeminiEngine:
    """See the module doc."""

    def __init__(self, model, zparams: ZeroParams, tx, *, axis: str, offload: Offload,
                 max_chunk_size: int | None = None):
        if not isinstance(zparams, ZeroParams):
            raise ValueError(f"GeminiEngine: params must be ZeroParams, got {type(zparams).__name__}; make "
                             f"them with cfx.zero.shard_params(params, axis={axis!r}) inside shard_map.")
        if not isinstance(offload, Offload):
            raise ValueError("GeminiEngine: pass offload=cfx.zero.offload(cfx.gemini.host(), ...).")
        check_axis_size(zparams, axis, "GeminiEngine")
        self.tx, self.axis, self.cfg, self.n = tx, axis, offload, zparams.n
        items, self.treedef = tree_util.flatten_with_path(zparams.pieces)
        self.paths, self.shapes = [p for p, _ in items], zparams.shapes
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
        self.tiers = ChunkStores(offload, nvme_dir=nvme)  # where each chunk's params, state and grads live
        self.stores, self.traffic = self.tiers.stores, self.tiers.traffic
        self.refs = [ChunkRef(self, g) for g in range(len(self.groups))]
        self.states = {g: S.FREE for g in range(len(self.groups))}  # per group (layer)
        self.placer = Placer(offload.policy, self.chunk_bytes, fetch=self._fetch, evict=self._evict)
        self.anchor: torch.Tensor | None = None
        pieces = [x for _, x in items]
        with torch.no_grad():
            shards = [concat_flat([pieces[i].detach() for i in g]) for g in self.groups]
            for c in range(self.chunks.n_chunks):
                chunk = self.chunks.pack(shards, c)
                self.tiers.put(self.cfg.param_home, ("param", c), chunk, "param")
                master = chunk.to(torch.float32, copy=True)
                if self.dtype != torch.float32:
                    self.tiers.put(self.cfg.optim_home, ("master", c), master, "optim")
                self.tiers.put_inner(c, self.tx.init((master,)))
            del shards
        if isinstance(offload.policy, DevicePolicy):
            for c in range(self.chunks.n_chunks):
                self.placer.fetch(c)

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
        key = ("param", c) if self.cfg.param_home == "device" else ("copy", c)
        return self.chunks.view(self.stores["device"].get(key), g)

    def _fetch(self, c) -> None:
        if self.cfg.param_home == "device":
            return
        x = self.tiers.get(self.cfg.param_home, ("param", c))
        self.tiers.put("device", ("copy", c), x, "chunk")
        self.traffic["host->device"] += self.chunk_bytes[c]

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
        chunk = self.tiers.grad_chunk(self.chunks.chunk_of[g], grad, self.chunks.size)
        self.chunks.view(chunk, g).add_(grad)

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
        try:
            with self.placer.step(agree=lambda v: lax.pmax(v, self.axis)):
                loss = fn(self.tree(), *args, **kwargs)
                torch.autograd.backward(loss, inputs=[self.anchor])
        finally:
            self.anchor = None
        return loss.detach()

    def update(self) -> None:
        """One optimizer step over every chunk, then drop the gradients."""
        with torch.no_grad():
            grads = [self.tiers.take_grad(c, self.chunks.size) for c in range(self.chunks.n_chunks)]
            # one all-reduce for the whole model's norm and inf/nan count; each chunk is stepped
            # inside cfx.optim.sharded with the rest of them, so clipping and the loss scaler
            # see every chunk of every rank
            sq = [g.pow(2).sum() for g in grads]
            bad = [(~torch.isfinite(g)).sum().to(torch.float32) for g in grads]
            total = lax.psum(torch.stack([sum(sq), sum(bad)]), self.axis)
            for c, g in enumerate(grads):
                with reduction.sharded([()], every=(), psum=lax.psum, rest_sq=(total[0] - sq[c]).clamp_min(0.0),
                                       rest_bad=total[1] - bad[c], no_leaf_norms=NO_LEAF_NORMS):
                    self._update_chunk(c, g)
        for c in sorted(self.resident):
            if isinstance(self.cfg.policy, DevicePolicy):
                if self.cfg.param_home != "device":
                    self.stores["device"].get(("copy", c)).copy_(self.tiers.get(self.cfg.param_home, ("param", c)))
                    self.traffic["host->device"] += self.chunk_bytes[c]
            else:
                self.placer.evict(c)

    def _update_chunk(self, c, g) -> None:
        home, ohome = self.cfg.param_home, self.cfg.optim_home
        p = self.tiers.get(home, ("param", c))
        low = self.dtype != torch.float32
        master = self.tiers.get(ohome, ("master", c)) if low else p
        (u,), inner = self.tx.update((g,), self.tiers.load_inner(c), (master,))
        if low:
            new_master = master + u
            self.tiers.write(ohome, ("master", c), new_master, "optim")
            new_p = new_master.to(self.dtype)
        else:
            new_p = p + u
        self.tiers.write(home, ("param", c), new_p, "param")
        self.tiers.write_inner(c, inner)

    def step(self, fn, *args, **kwargs) -> torch.Tensor:
        loss = self.backward(fn, *args, **kwargs)
        self.update()
        return loss

    def params(self) -> ZeroParams:
        """This rank's pieces (fresh tensors), as ``ZeroParams``."""
        leaves = [None] * len(self.paths)
        for c, gs in enumerate(self.chunks.groups):
            chunk = self.tiers.get(self.cfg.param_home, ("param", c))
            for g in gs:
                for i, piece in zip(self.groups[g], self.layouts[g].split_shard(self.chunks.view(chunk, g))):
                    leaves[i] = piece.clone()
        return ZeroParams(tree_util.unflatten(self.treedef, leaves), self.shapes, self.n)

    def close(self) -> None:
        """Drop every chunk, gradient and optimizer state from the stores (NVMe files and the
        engine's NVMe directory included; an engine that is garbage collected does the same)."""
        for store in self.stores.values():
            store.close()
        self.placer.resident.clear()

    def inner_state(self, c: int = 0):
        """The optimizer state of chunk ``c`` (e.g. to read a loss scale: every chunk's is the same)."""
        return self.tiers.load_inner(c)

