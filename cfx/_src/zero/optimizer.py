"""``cfx.zero(tx, stage=..., axis=...)``: ZeRO stages 0-3 around any ``cfx.optim`` transformation.

Used inside ``shard_map``; every rank calls the same methods::

    ztx = cfx.zero(cfx.optim.adamw(1e-3), stage=2, axis="data")
    state = ztx.init(params)
    loss, grads = ztx.value_and_grad(loss_fn)(params, batch)   # see "Gradients" below
    updates, state = ztx.update(grads, state, params)
    params = cfx.optim.apply_updates(params, updates)

The leaves are cut into optimizer *groups* (consecutive leaves, at most ``bucket_numel``
elements, one dtype; ``flat.make_groups``). Per group, stage by stage:

- 0 (plain data parallel): all-reduce the flat gradient; the optimizer runs on every whole group.
- 1: reduce-scatter the gradient into this rank's shard; the optimizer state covers the shard
  only; the updated shard is all-gathered back.
- 2: as 1, but ``value_and_grad`` reduce-scatters each group (bucket) *during* backward, as soon
  as all its gradients exist, and returns ``ShardGrads``: the full gradient never persists.
- 3: params are ``ZeroParams`` (pieces, see ``params``) run through ``cfx.zero.gathered`` layers,
  whose backward already reduce-scatters; the update is local, nothing is gathered.

The wrapped ``tx`` sees the params' own tree whose every leaf is this rank's 1-D *piece* of that
leaf (views into the group shards; at stage 0 the whole flattened leaf), and runs inside
``cfx.optim.sharded``: each piece's sum of squares is ``psum``'d over the ZeRO axis and the
leaf's other axes, so per-leaf rules (``lamb`` / ``lars`` trust ratios, weight-decay masks, which
are functions of the tree) and global norms (``clip_by_global_norm``) see the whole parameter, and
an inf/nan on any rank skips the step on every rank (``dynamic_loss_scale``).

Gradients are *averaged* over the ZeRO axis, as DDP and FSDP average them: for a loss that is
the mean over each rank's batch, the step is the single-device step on the whole batch.
``value_and_grad`` returns, at stages 0-1, this rank's own gradient (of its batch; ``update``
averages it in the all-reduce / reduce-scatter it needs anyway), at stage 2 ``ShardGrads`` (this
rank's shard of the mean gradient) and at stage 3 ``ZeroParams`` of the mean gradient's pieces
(the gathered layers' backward averages): each equal to that slice of the single-device gradient.
In a body that tracks varying axes (``shard_map(..., check_vma=True)``) the params ``fun`` sees
are this rank's own copies, typed as varying over the axis, so no implicit ``pvary`` sums their
gradients before ZeRO averages them (the values are the same in both modes); ``update``'s
updates are typed as their params, the master shards as varying over the axis.

Mixed precision is the ZeRO paper's: params (and grads) in fp16/bf16, an fp32 master shard in
the state (``ZeroState.master``); fp32 params are their own master (no copy).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import donation
from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.lax import vma
from cfx._src.mesh import context as ctx_lib
from cfx._src.optim import reduction
from cfx._src.transforms.autodiff import value_and_grad as _value_and_grad
from cfx._src.zero.buckets import ShardGrads, bucketed_value_and_grad
from cfx._src.zero.flat import concat_flat
from cfx._src.zero.gathered import grads_captured
from cfx._src.zero.layout import ZeroLayout, group_shards, layout_of, piece_tree, state_specs_of
from cfx._src.zero.params import ZeroParams


class ZeroState(NamedTuple):
    master: tuple   # per group: fp32 master shard for fp16/bf16 params, None for fp32 params
    inner: Any      # the wrapped transformation's state over this rank's pieces


def _watch(tree: Any, kind: str, tier: str) -> None:
    for x in tree_util.leaves(tree):
        if isinstance(x, torch.Tensor):
            memory.watch(x, tier=tier, kind=kind)


@dataclasses.dataclass(frozen=True)
class ZeroTransformation:
    """See the module doc. ``param_specs``: the params' specs on other mesh axes (tensor
    parallelism), so norms and inf checks sum over them too; None: replicated there."""

    tx: Any
    stage: int
    axis: str
    param_specs: Any = None
    bucket_numel: int = 1 << 22
    owner_axes: Any = None  # per params leaf: axes over which other ranks hold *other* leaves there
    tier: str = "device"    # where cfx.memory books its params, grads and state (host: offloaded)

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"cfx.zero: stage={self.stage!r}; use 0 (plain data parallel), 1 (shard the "
                             "optimizer state), 2 (+ gradients) or 3 (+ parameters).")
        if not (callable(getattr(self.tx, "init", None)) and callable(getattr(self.tx, "update", None))):
            raise ValueError(f"cfx.zero: tx is a {type(self.tx).__name__}, not a GradientTransformation; "
                             "pass e.g. cfx.optim.adamw(1e-3).")
        if not isinstance(self.axis, str):
            raise ValueError(f"cfx.zero: axis must be one mesh axis name, got {self.axis!r}.")
        if self.bucket_numel < 1:
            raise ValueError(f"cfx.zero: bucket_numel={self.bucket_numel} must be >= 1 elements.")
        object.__setattr__(self, "_checked", set())  # params layouts seen replicated (_check_replicated)

    # -- layout -------------------------------------------------------------------------------
    def layout(self, params: Any) -> ZeroLayout:
        """The groups for ``params`` (pieces when ``stage == 3``) on this rank's mesh (``layout.layout_of``)."""
        return layout_of(self, params)

    @staticmethod
    def _param_leaves(params: Any) -> list[torch.Tensor]:
        return tree_util.leaves(params.pieces if isinstance(params, ZeroParams) else params)

    def _masters(self, leaves: list, layout: ZeroLayout) -> list[torch.Tensor]:
        """This rank's fp32 shard per group, cut from the params."""
        r = lax.axis_index(self.axis) if self.stage in (1, 2) else 0
        out = []
        for idx, lay, _ in layout.groups:
            xs = [leaves[i] for i in idx]
            shard = lay.shard_of(xs, r) if self.stage in (1, 2) else concat_flat(xs)
            shard = shard.detach().to(torch.float32)
            out.append(vma.declare_varying(shard, (self.axis,)) if self.stage in (1, 2) else shard)
        return out

    # -- the transformation -------------------------------------------------------------------
    def init(self, params: Any) -> ZeroState:
        layout = self.layout(params)
        with torch.no_grad():
            masters = self._masters(self._param_leaves(params), layout)
            inner = self.tx.init(piece_tree(masters, layout))
        keep = tuple(m if dt != torch.float32 else None for m, (_, _, dt) in zip(masters, layout.groups))
        state = ZeroState(keep, inner)
        _watch(params.pieces if isinstance(params, ZeroParams) else params, "param", self.tier)
        _watch(state, "optim", self.tier)
        return state

    def update(self, grads: Any, state: ZeroState, params: Any) -> tuple[Any, ZeroState]:
        """Updates for ``params`` from ``value_and_grad``'s grads (see "Gradients" in the module doc)."""
        if params is None:
            raise ValueError("cfx.zero: update needs the params; call ztx.update(grads, state, params).")
        layout = self.layout(params)
        if not isinstance(state, ZeroState) or len(state.master) != len(layout.groups):
            raise ValueError(f"cfx.zero: state is not this transformation's ZeroState for these params "
                             f"({len(layout.groups)} groups); pass the state from ztx.init / ztx.update.")
        with torch.no_grad():
            leaves = self._param_leaves(params)
            self._check_replicated(leaves, layout)
            shards = self._reduce(grads, layout)
            derived = self._masters(leaves, layout) if any(m is None for m in state.master) else None
            masters = [m if m is not None else derived[g] for g, m in enumerate(state.master)]
            # per-leaf pieces; norms and inf/nan checks over every rank's pieces of each leaf
            with donation.donated(shards), self._sharded(layout):  # our flat copies: the update may reuse them
                u_tree, inner = self.tx.update(piece_tree(shards, layout), state.inner, piece_tree(masters, layout))
            us = group_shards(u_tree, layout)
            new_master = tuple(None if m is None else masters[g] + us[g] for g, m in enumerate(state.master))
            updates = self._expand(us, new_master, layout, leaves, params)
        new_state = ZeroState(new_master, inner)
        _watch(new_state, "optim", self.tier)
        return updates, new_state

    def _check_replicated(self, leaves: list[torch.Tensor], layout: ZeroLayout) -> None:
        """Without ``param_specs`` every leaf counts as replicated over the mesh's other axes, so
        a norm (clipping, LAMB / LARS, the fp16 inf check) sums its squares once. A leaf whose
        values differ across one of those axes is split over it (tensor parallelism) and that
        norm would be silently wrong: refuse, on every rank alike, naming the leaf, the axes and
        the fix. Checked once per params layout (one all-reduce of a number per leaf); not inside
        a compiled step (``cfx.jit``), whose first eager step should make it."""
        if self.param_specs is not None or torch.compiler.is_dynamo_compiling():
            return
        ctx = ctx_lib.current("cfx.zero")
        mesh, key = ctx.mesh, (ctx.rank, layout.paths)  # per rank: each makes the same checks in turn
        others = tuple(a for a in mesh.axis_names if a != self.axis and mesh.shape[a] > 1)
        if not others or key in self._checked:
            return
        sq = torch.stack([x.detach().float().square().sum() for x in leaves]) if leaves else torch.zeros(0)
        hi, lo = lax.pmax(sq, others), lax.pmin(sq, others)
        differs = ((hi != lo) & ~(hi.isnan() & lo.isnan())).float()  # a non-finite leaf is no sharding
        differs = lax.pmax(differs, tuple(mesh.axis_names))  # one verdict on every rank of the mesh
        bad = [layout.paths[i] for i in torch.nonzero(differs).flatten().tolist()]
        if bad:
            raise ValueError(
                f"cfx.zero: params leaf {bad[0]!r}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} "
                f"differs across mesh axes {list(others)} of {mesh!r}: it is split there (tensor "
                "parallelism), but no param_specs were given, so norms (clipping, LAMB / LARS, the fp16 "
                "inf check) would count it as whole. Pass the params' specs: cfx.zero(tx, stage=..., "
                f"axis={self.axis!r}, param_specs=rules.specs(model.axes(), mesh=mesh)).")
        self._checked.add(key)

    def _sharded(self, layout: ZeroLayout):
        every = sorted({a for axes in layout.total_axes for a in axes} | ({self.axis} if self.stage else set()))
        return reduction.sharded(layout.axes, total_axes=layout.total_axes, every=tuple(every), psum=lax.psum)

    def _reduce(self, grads: Any, layout: ZeroLayout) -> list[torch.Tensor]:
        """Per group, this rank's fp32 shard of the gradient averaged over the axis (a fresh
        tensor: the update may reuse it)."""
        n_axis = lax.axis_size(self.axis)
        if isinstance(grads, ShardGrads):
            if self.stage != 2 or len(grads.shards) != len(layout.groups):
                raise ValueError(f"cfx.zero(stage={self.stage}): got ShardGrads of {len(grads.shards)} groups; "
                                 "they come from the same stage-2 ztx.value_and_grad on these params.")
            return [s.to(torch.float32, copy=True) for s in grads.shards]  # averaged in backward
        g_leaves = self._param_leaves(grads) if self.stage == 3 else tree_util.leaves(grads)
        if self.stage == 3 and not isinstance(grads, ZeroParams) or len(g_leaves) != len(layout.paths):
            raise ValueError(f"cfx.zero(stage={self.stage}): grads do not match the params "
                             f"({len(g_leaves)} vs {len(layout.paths)} leaves); pass the gradient of the loss "
                             "w.r.t. these params (ztx.value_and_grad).")
        out = []
        for idx, lay, dt in layout.groups:
            gs = [g_leaves[i] for i in idx]
            if self.stage == 3:    # already reduce-scattered and averaged by the gathered layers' backward
                out.append(concat_flat(gs).to(torch.float32))
                continue
            if self.stage == 0:
                flat = lax.psum(concat_flat([g.to(dt) for g in gs]), self.axis)
            else:
                flat = lax.psum_scatter(lay.rows_from_leaves(gs, dtype=dt), self.axis, dim=0, tiled=False)
            out.append(flat.to(torch.float32).div_(n_axis))  # flat is fresh: divide in place
        return out

    def _expand(self, us, new_master, layout: ZeroLayout, leaves, params) -> Any:
        """Per-leaf updates from per-group update shards (gathered at stages 1 and 2)."""
        out: list = [None] * len(leaves)
        for (idx, lay, dt), u, m in zip(layout.groups, us, new_master):
            x = u if m is None else m.to(dt)   # fp32: gather the update; else: the new params
            if self.stage in (1, 2):
                full = lay.full_from_rows(lax.all_gather(x, self.axis))
                parts = lay.leaves_of_full(full)
            else:
                parts = list(x.split(lay.numels if self.stage == 0 else lay.pieces))
            for i, part in zip(idx, parts):
                part = part.view(leaves[i].shape)
                out[i] = part if m is None else part - leaves[i].detach()
                if vma.is_tracking():  # typed as its param, as the leafwise pmean-then-update would be
                    vma.mark(out[i], vma.varying_axes(leaves[i]))  # a fresh view or difference
        if isinstance(params, ZeroParams):
            return ZeroParams(tree_util.unflatten(tree_util.structure(params.pieces), out), params.shapes, params.n)
        return tree_util.unflatten(tree_util.structure(params), out)

    def state_specs(self, params: Any, *, mesh) -> ZeroState:
        """Specs of the ``ZeroState`` that ``init`` makes from ``params`` (the global, unsharded
        params, even at stage 3) on ``mesh``, for ``shard_map`` in/out specs across steps
        (``layout.state_specs_of``)."""
        return ZeroState(*state_specs_of(self, params, mesh=mesh))

    def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
        """``cfx.value_and_grad(fun)`` w.r.t. the first argument (the params), stage-aware:
        stage 2 returns ``ShardGrads`` reduce-scattered bucket by bucket during backward; stages
        2-3 return the gradient averaged over the axis (see "Gradients" in the module doc)."""

        @functools.wraps(fun)
        def wrapped(params, *args, **kwargs):
            _watch(params.pieces if isinstance(params, ZeroParams) else params, "param", self.tier)
            if self.stage == 2:
                out, grads = bucketed_value_and_grad(fun, self.layout(params), self.axis, params, args,
                                                     kwargs, has_aux=has_aux)
            elif self.stage == 3:  # the gathered layers' reduce-scatters complete at the end of backward
                with grads_captured():
                    out, grads = _value_and_grad(_own_copies(fun, self.axis), has_aux=has_aux)(params, *args,
                                                                                              **kwargs)
            else:
                out, grads = _value_and_grad(_own_copies(fun, self.axis), has_aux=has_aux)(params, *args, **kwargs)
            _watch(grads, "grad", self.tier)
            return out, grads

        return wrapped


def _own_copies(fun: Callable[..., Any], axis: str) -> Callable[..., Any]:
    """``fun`` seeing the params it is differentiated w.r.t. as this rank's own copies: where the
    body tracks varying axes, typed as varying over ``axis`` (ZeRO averages their gradients)."""
    @functools.wraps(fun)
    def on_copies(params, *args, **kwargs):
        for x in tree_util.leaves(params):  # cfx.grad's fresh leaves, not the caller's tensors
            vma.declare_varying(x, (axis,))
        return fun(params, *args, **kwargs)
    return on_copies
