"""``shard_map``: run a function once per rank on local blocks, with JAX's semantics.

``in_specs`` / ``out_specs`` are pytree prefixes of the arguments / outputs whose leaves are
``P`` specs. Arguments may be:

* ``ShardedArray`` s: a block whose spec already equals the in_spec is handed to the body as is
  (no copy); another layout is converted inside each rank by ``reshard``'s planned collectives
  (never by gathering the global value);
* global ``torch.Tensor`` s (a notebook's convenience): each rank gets a copy of its slice;
* anything else (ints, strings, None) with spec ``P()``: passed through.

Every tensor output comes back as a ``ShardedArray`` with its out_spec, each process keeping the
blocks of its own ranks: nothing is gathered, pickled or assembled. A mesh axis absent from an
out_spec says the output is replicated along it, and that is checked by default (``check_rep``:
from the varying-axes types where the body tracks them, and by comparing a sample of each
replicated output's elements across its replicas; ``"full"`` compares every element, ``False``
skips it; see ``replication``). All validation of the inputs happens before any rank starts, so a
bad spec is a ValueError naming the leaf path, the mesh and the fix, never a hang.

Differentiation. ``cfx.grad`` of a function that calls ``shard_map`` differentiates through it
(JAX's ``check_vma=True`` semantics): the body runs with varying-axes tracking that implicitly
``pvary``s invariant values where they meet varying ones, each rank's backward runs in that rank
(the collectives' transposes pair up), and gradients come back laid out like the inputs
(``sharded``'s anchors and cells). Inside a body, ``cfx.grad`` follows the call's ``check_vma``
as JAX's does: with ``check_vma=True`` (or in a body differentiated from outside) the gradient of
an input invariant over an axis is ``psum``'d over the axes it met varying values on (the implicit
``pvary``'s transpose) and is typed invariant; with ``check_vma=False`` (the default) nothing is
inserted and each rank gets its own partial gradients, to be reduced explicitly (``tree_pmean``),
which lets data parallelism bucket its all-reduce. (Explicit collectives transpose the same way in
both modes: ``psum``'s transpose is the identity, where JAX's ``check_vma=False`` psums.)

``donate_argnums``: those arguments' ShardedArrays are given up to the call (JAX's donation).
Each output block takes over the storage of a donated input block with the same shape, dtype
and spec (written in place), and the donated arrays are marked deleted: touching one raises.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch

from cfx._src.core import donation
from cfx._src.mesh import layout
from cfx._src.spmd import replication
from cfx._src.core import tree as tree_util
from cfx._src.lax import vma
from cfx._src.mesh import context as ctx_lib
from cfx._src.mesh.spec import P, is_spec
from cfx._src.spmd.resharding import find_path, run_steps, same_layout
from cfx._src.spmd.sharded import Cell, ShardedArray, same_layout_mesh
from cfx._src.spmd.spec_tree import broadcast_specs


class _Input:
    """One argument leaf and how each rank gets its block of it."""

    __slots__ = ("path", "leaf", "spec", "kind", "steps", "diff")

    def __init__(self, path: str, leaf: Any, spec: P, mesh):
        self.path, self.leaf, self.spec, self.steps, self.diff = path, leaf, spec, (), False
        if isinstance(leaf, ShardedArray):
            self.kind = "array"
            if not same_layout_mesh(leaf.mesh, mesh):
                raise ValueError(f"shard_map: in_specs leaf {path!r} is a ShardedArray on {leaf.mesh!r}, but "
                                 f"this call runs on {mesh!r}. Move it with cfx.device_put(cfx.device_get(x), "
                                 "mesh, spec), or build it on this mesh.")
            if leaf.is_deleted():
                raise ValueError(f"shard_map: in_specs leaf {path!r} is a ShardedArray that was {leaf._deleted}; "
                                 "pass the output of the call that took it instead.")
            layout.check_spec(path, leaf.shape, spec, mesh, "shard_map in_specs")
            if leaf.partial or not same_layout(leaf.spec, spec, len(leaf.shape)):
                try:
                    self.steps = find_path(leaf.spec, spec, leaf.shape, mesh, itemsize=leaf.element_size(),
                                              partial=leaf.partial).steps
                except ValueError as e:
                    raise ValueError(f"shard_map: in_specs leaf {path!r}: {e} Give the array a spec that "
                                     "divides its shape, or reshard it first.") from None
            self.diff = leaf.requires_grad
        elif isinstance(leaf, torch.Tensor):
            self.kind = "tensor"
            layout.check_spec(path, tuple(leaf.shape), spec, mesh, "shard_map in_specs")
            self.diff = leaf.requires_grad
        else:
            self.kind = "static"
            if len(spec):
                raise ValueError(f"shard_map: in_specs leaf {path!r} is a {type(leaf).__name__}, which cannot "
                                 "be split; give it P().")

    def block(self, rank: int, mesh, differentiable: bool, track: bool) -> tuple[Any, torch.Tensor | None]:
        """``(the body's value, the per-rank leaf to differentiate or None)`` on ``rank``; with
        ``track``, the value is a new tensor object tagged with the in_spec's axes."""
        if self.kind == "static":
            return self.leaf, None
        proxy = None
        if self.kind == "array":
            x = self.leaf.blocks[rank]  # used as is: no copy
            if differentiable and self.diff:
                x = proxy = x.detach().requires_grad_(True)
            elif track and not self.steps:
                x = x.detach()  # a new tensor object over the same storage, to carry the tag
            if self.steps:
                x = run_steps(x, self.steps)
        else:
            x = layout.block_of(self.leaf.detach(), self.spec, mesh, mesh.coords(rank)).clone()
            if differentiable and self.diff:
                proxy = x.requires_grad_(True)
        return vma.mark(x, self.spec.all_axes()) if track else x, proxy


class _Call:
    """One call of a shard_mapped function: validated inputs, per-rank runs, outputs."""

    def __init__(self, f, mesh, in_specs, out_specs, check_rep: bool | str, donate: Sequence[int], args: tuple,
                 check_vma: bool = False):
        self.f, self.mesh, self.out_specs, self.check_rep = f, mesh, out_specs, check_rep
        specs = in_specs if isinstance(in_specs, tuple) and not is_spec(in_specs) else (in_specs,)
        if len(specs) != len(args):
            raise ValueError(f"shard_map: got {len(args)} arguments but {len(specs)} in_specs on "
                             f"{mesh!r}; give one spec (or spec pytree) per positional argument.")
        self.inputs = [_Input(p, x, s, mesh) for p, x, s in broadcast_specs(tuple(specs), tuple(args),
                                                                              "in_specs", mesh)]
        self.treedef = tree_util.structure(tuple(args))
        self.grad_mode = torch.is_grad_enabled()  # the caller's; rank threads have their own
        self.differentiable = self.grad_mode and any(i.diff for i in self.inputs)
        self.track = check_vma or self.differentiable
        self.donated = self._donated(donate, args)
        self.proxies: dict[int, list] = {}
        self.outs: dict[int, list] = {}

    def _donated(self, donate: Sequence[int], args: tuple) -> list[ShardedArray]:
        out = []
        for n in donate:
            if not -len(args) <= n < len(args):
                raise ValueError(f"shard_map: donate_argnums={tuple(donate)!r} but the call has {len(args)} "
                                 "arguments.")
            out += [x for x in tree_util.leaves(args[n]) if isinstance(x, ShardedArray)]
        if out and self.differentiable:
            raise ValueError("shard_map: donated arguments cannot be differentiated through (their buffers "
                             "are overwritten); drop donate_argnums under cfx.grad.")
        return out

    # -- forward -------------------------------------------------------------------------------
    def on_rank(self, rank: int):
        mesh = self.mesh
        with contextlib.ExitStack() as stack:  # only what this call needs: the common one is cheap
            if torch.is_grad_enabled() != self.grad_mode:
                stack.enter_context(torch.set_grad_enabled(self.grad_mode))
            leaves, proxies = [], []
            for inp in self.inputs:
                x, proxy = inp.block(rank, mesh, self.differentiable, self.track)
                leaves.append(x)
                if inp.diff and self.differentiable:
                    proxies.append(proxy)
            if self.track:
                stack.enter_context(vma.tracking())
            if self.donated:  # the body may overwrite these blocks
                stack.enter_context(donation.donated([a._blocks[rank] for a in self.donated]))
            out = self.f(*tree_util.unflatten(self.treedef, leaves))
        flat, treedef = tree_util.flatten(out)
        self._check_rep_on_rank(flat, treedef)
        if self.differentiable:
            self.proxies[rank], self.outs[rank] = proxies, flat
            flat = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
        elif self.donated:
            flat = self._write_into_donated(rank, flat, treedef)
        else:
            flat = [x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in flat]
        return treedef, flat

    def _check_rep_on_rank(self, flat: list, treedef) -> None:
        """What the replication check does inside a rank: the types' verdict (the same on every
        rank), and under ``dist`` the exchange of samples (here, as it is a collective)."""
        dist = len(self.mesh.local_ranks) < self.mesh.size
        if not self.check_rep or not (self.track or dist):
            return
        items = replication.out_items(self.out_specs, flat, treedef, self.mesh)
        if self.track:
            replication.check_types(items, self.mesh, vma.varying_axes)
        if dist:
            from cfx._src.lax import collectives as lax
            replication.check_values_dist(items, self.mesh, self.check_rep, lax.all_gather)

    def _write_into_donated(self, rank: int, flat: list, treedef) -> list:
        """Each output block in a donated block of its shape, dtype and spec: first the outputs
        the body already computed in place claim their own buffers, then the others are copied
        into free ones (never into a buffer an output still lives in)."""
        specs = [s for _, _, s in broadcast_specs(self.out_specs, tree_util.unflatten(treedef, flat),
                                                   "out_specs", self.mesh)]
        blocks = [a._blocks[rank] for a in self.donated]
        out = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
        fits = lambda i, j: (blocks[j].shape == out[i].shape and blocks[j].dtype == out[i].dtype  # noqa: E731
                             and not self.donated[j].partial and same_layout(self.donated[j].spec, specs[i], out[i].dim()))
        return donation.write_into(out, blocks, fits)

    def run(self):
        results = self.mesh.run(self.on_rank)
        ranks = sorted(results)
        treedef = results[ranks[0]][0]
        for r in ranks[1:]:
            if results[r][0] != treedef:
                raise ValueError(f"shard_map: rank {r} returned a different pytree structure than rank "
                                 f"{ranks[0]} on {self.mesh!r}; every rank must return the same structure.")
        first = tree_util.unflatten(treedef, results[ranks[0]][1])
        items = broadcast_specs(self.out_specs, first, "out_specs", self.mesh)
        outs, blocks = [], [{r: results[r][1][i] for r in ranks} for i in range(len(items))]
        for (path, leaf, spec), per_rank in zip(items, blocks):
            outs.append(self._output(path, leaf, spec, per_rank))
        for a in self.donated:
            a.delete(f"donated to {getattr(self.f, '__name__', 'a shard_map call')}")
        if self.check_rep and len(ranks) == self.mesh.size:  # every replica is here: compare in place
            replication.check_values(items, blocks, self.mesh, self.check_rep)
        self.results_treedef = treedef
        return outs

    def _output(self, path: str, leaf: Any, spec: P, blocks: dict[int, Any]) -> Any:
        mesh = self.mesh
        if not isinstance(leaf, torch.Tensor):
            return leaf
        layout.check_spec(path, tuple(leaf.shape), spec, mesh, "shard_map out_specs", block=True)
        for r, b in blocks.items():
            if not isinstance(b, torch.Tensor) or b.shape != leaf.shape or b.dtype != leaf.dtype:
                got = f"shape {tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor) else type(b).__name__
                raise ValueError(f"shard_map: output {path or '<root>'!r} is {got} on rank {r} but shape "
                                 f"{tuple(leaf.shape)} {leaf.dtype} on another rank of {mesh!r}; every rank "
                                 "must return blocks of one shape and dtype.")
        return ShardedArray(layout.global_shape(leaf.shape, spec, mesh), spec, mesh, blocks)

    # -- backward ------------------------------------------------------------------------------
    def backward(self, cells: list) -> list:
        """Per-rank backward from the outputs' cotangent cells; returns one gradient per
        differentiable input: global tensors' gradients, None for ShardedArrays (whose blocks go
        to their cells)."""
        mesh = self.mesh
        cts = [None if c is None else c.take() for c in cells]
        diff_inputs = [inp for inp in self.inputs if inp.diff]

        def on_rank(rank: int):
            outs, grads_out = [], []
            for o, ct in zip(self.outs[rank], cts):
                if ct is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                    outs.append(o)
                    grads_out.append(ct[rank])
            proxies = self.proxies[rank]
            if not outs:
                return [None] * len(proxies)
            return list(torch.autograd.grad(outs, proxies, grads_out, allow_unused=True))

        per_rank = mesh.run(on_rank) if any(c is not None for c in cts) else None
        self.outs, self.proxies = {}, {}
        grads = []
        for j, inp in enumerate(diff_inputs):
            got = {r: (None if per_rank is None else per_rank[r][j]) for r in (per_rank or {r: 0 for r in
                                                                                        mesh.local_ranks})}
            if inp.kind == "array":
                arr = inp.leaf
                arr.deposit({r: g if g is not None else torch.zeros_like(arr.blocks[r]) for r, g in got.items()})
                grads.append(None)  # the anchor's gradient: the blocks went to the array's cell
            else:
                grads.append(self._global_grad(inp, got))
        return grads

    def _global_grad(self, inp: _Input, got: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """A global tensor input's gradient: each replica set's cotangent taken once (they agree)."""
        mesh, x = self.mesh, inp.leaf
        out = torch.zeros_like(x)
        for r, g in got.items():
            coords = mesh.coords(r)
            if g is not None and layout.is_primary(inp.spec, mesh, coords):
                layout.block_of(out, inp.spec, mesh, coords).copy_(g)
        if len(got) < mesh.size:  # dist: every process holds its ranks' part; sum them everywhere
            from cfx._src.lax import collectives as lax
            out = mesh.run(lambda r: lax.psum(out, mesh.axis_names))[mesh.local_ranks[0]]
        return out


class _CallFn(torch.autograd.Function):
    """The call as one node of the caller's graph (inputs: anchors and global tensors)."""

    @staticmethod
    def forward(ctx, call, holder, *tensors):
        del tensors
        ctx.set_materialize_grads(False)
        ctx.call, ctx.holder = call, holder
        holder.outs = call.run()
        holder.n_anchored = sum(isinstance(o, ShardedArray) and o.dtype.is_floating_point for o in holder.outs)
        return tuple(torch.zeros(()) for _ in range(holder.n_anchored))

    @staticmethod
    def backward(ctx, *_):
        call, cells = ctx.call, ctx.holder.cells
        ctx.call = ctx.holder = None
        return (None, None, *call.backward(cells))


class _Holder:
    __slots__ = ("outs", "n_anchored", "cells")


def _run_differentiable(call: _Call) -> list:
    tensors = [inp.leaf._anchor if inp.kind == "array" else inp.leaf for inp in call.inputs if inp.diff]
    holder = _Holder()
    anchors = _CallFn.apply(call, holder, *tensors)
    anchors = list(anchors) if isinstance(anchors, tuple) else [anchors]
    cells, out, k = [], [], 0
    for o in holder.outs:
        if isinstance(o, ShardedArray) and o.dtype.is_floating_point:
            cell = Cell()
            o = o.with_anchor(anchors[k], cell)
            k += 1
            cells.append(cell)
        elif isinstance(o, ShardedArray):
            cells.append(None)
        out.append(o)
    # cotangents arrive per array output (in order); other outputs have none
    holder.cells = cells
    call.outs = {r: [x for x, o in zip(xs, holder.outs) if isinstance(o, ShardedArray)]
                 for r, xs in call.outs.items()}
    return out


def shard_map(f: Callable[..., Any], *, mesh, in_specs: Any, out_specs: Any, check_rep: bool | str = True,
              check_vma: bool = False, donate_argnums: int | Sequence[int] = ()) -> Callable[..., Any]:
    """``f`` run per rank of ``mesh`` on blocks of its arguments; see the module docstring.

    ``check_rep``: ``True`` (default) refuses an output that differs along an axis its out_spec
    leaves out, judged by its varying-axes type where tracked and by a sample of its elements;
    ``"full"`` compares every element; ``False`` trusts the out_specs.

    ``check_vma``: track every value's varying axes (``cfx.lax.varying_axes``) even when the call
    is not differentiated from outside (where it always is), with JAX's implicit ``pvary``s, so a
    ``cfx.grad`` in the body sums an invariant input's gradient as ``jax.shard_map`` does (module
    doc); a Python hook per op.
    """
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return _mapped(f, mesh, in_specs, out_specs, replication.check_mode(check_rep), check_vma, donate, ())


def _check_not_nested(f, mesh) -> None:
    """A shard_map called from a rank's body would wait for ranks that are busy in the outer one
    (a hang): refuse at once, on every rank that makes the call."""
    outer = ctx_lib.current_or_none()
    if outer is not None:
        name = getattr(f, "__name__", "the function")
        raise ValueError(f"shard_map({name}) on {mesh!r} was called inside the body of another shard_map "
                         f"(rank {outer.rank} of {outer.mesh!r}); nesting is not supported. Inside a body "
                         "each rank already holds its blocks and cfx.lax collectives reach every mesh axis: "
                         f"call {name} directly there, or call the inner shard_map outside the outer body.")


def _mapped(f, mesh, in_specs, out_specs, check_rep: bool | str, check_vma: bool, donate: tuple,
            body_donates: tuple) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapped(*args):
        _check_not_nested(f, mesh)
        call = _Call(f, mesh, in_specs, out_specs, check_rep, donate, args, check_vma)
        outs = _run_differentiable(call) if call.differentiable else call.run()
        for n in body_donates:  # the body took these blocks' buffers (a cfx.jit with donate_argnums)
            for a in tree_util.leaves(args[n]):
                if isinstance(a, ShardedArray):
                    a.delete(f"donated to {getattr(f, '__name__', 'a shard_map call')}")
        return tree_util.unflatten(call.results_treedef, outs)

    def with_body(transform: Callable[[Callable], Callable], *, body_donates: Sequence[int] = ()):
        """The same shard_map over ``transform(f)`` (``cfx.jit(shard_map(f))`` is
        ``shard_map(cfx.jit(f))``); ``body_donates``: arguments whose blocks the new body takes."""
        kept = tuple(n for n in donate if n not in body_donates)
        return _mapped(transform(f), mesh, in_specs, out_specs, check_rep, check_vma, kept, tuple(body_donates))

    wrapped.cfx_with_body = with_body
    return wrapped
