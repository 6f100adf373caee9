"""``cfx.zero.gathered(layer, axis=...)``: ZeRO-3 as a layer transform.

Same ``init`` / ``axes`` as ``layer``; ``apply`` (and ``loss``, for a model) takes the layer's
params as stored by ZeRO-3 -- ``ZeroParams``, or the ``ShardedLeaf`` tree a gathered parent
passes down -- and:

1. *gathers just before the layer runs*: its own pieces, packed as one shard (S,), are
   all-gathered in one collective and copied into a padded leaf-major buffer whose slices are
   the leaves (``flat``);
2. *frees after*: while the layer runs, a saved-tensor hook replaces every tensor autograd saves
   that lives in that buffer (a weight kept for the input gradient, its transpose, ...) by a
   small ``_Ref(offset, size, stride)`` (``regather.py``), so when ``apply`` returns nothing holds the buffer;
3. *re-gathers in backward*: the first ``_Ref`` unpacked in backward all-gathers the shard
   again and every ``_Ref`` of the layer is served from that one buffer (except, inside
   ``ztx.value_and_grad``, for the step's outermost gathered layer: its backward begins where
   forward ends, so what it saved stays gathered, as FSDP keeps its root);
4. *reduce-scatters the gradient*: the gather is an autograd function whose backward packs the
   leaves' gradients into rows (n, S), reduce-scatters them and divides by n -- each piece's
   gradient is its slice of the gradient *averaged* over ``axis``, which for a loss averaged over
   this rank's batch is the single-device gradient of the whole batch (DDP's and FSDP's mean);
   it runs after every use of the layer's params in backward, and drops the re-gathered buffer.

So at any moment only the layers being computed are gathered, never the whole model (and,
inside ``ztx.value_and_grad``, the one gather prefetched next: ``prefetch.py``). Wrap the
blocks first, then the model for what is left (embeddings, final norm), as FSDP does::

    zmodel = cfx.zero.gathered(model.map_blocks(lambda b: cfx.zero.gathered(b, axis="data")),
                               axis="data")

A gathered layer skips the params of the sub-layers that are themselves gathered: the entries
``params[f]`` / ``params[f][i]`` of its dataclass fields ``f`` holding (a tuple of) gathered
layers (``blocks`` for the cfx models), found also inside the sublayers of composites that are
not gathered themselves (``params["down_blocks"][0]["resnets"][1]`` of a UNet). Plain tensors pass through untouched, so the same
model runs unsharded. Composes with remat as ``cfx.remat(cfx.zero.gathered(b))``: tensors the
hook does not own go to the enclosing hooks (remat re-gathers while recomputing).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.context import in_backward
from cfx._src.zero.regather import RegatherHooks
from cfx._src.zero import prefetch
from cfx._src.zero.flat import GroupLayout, concat_flat
from cfx._src.zero.params import ShardedLeaf, ZeroParams
from cfx._src.zero.fp8_gather import Float8Source, GatherFp8Fn, over_axes
from cfx._src.zero.source import GatherFn, ShardSource


@contextlib.contextmanager
def grads_captured():
    """Inside, the gathered layers' gradients are returned by ``torch.autograd.grad`` (as
    ``ztx.value_and_grad`` does), never accumulated into ``.grad`` during backward, and backward
    runs once, in the reverse order of forward. So the reduce-scatters of layers whose pieces are
    those leaves themselves (not casts of them) may complete at the end of backward, and gathers
    are prefetched in forward and in backward (``prefetch.py``)."""
    with prefetch.step_scope():
        yield


@contextlib.contextmanager
def frozen_gathered(src: ShardSource):
    """The leaves of a group no gradient flows to (a LoRA adapter's frozen base) from this rank's
    shard, read from ``src``: all-gathered now; while inside, what autograd saves of them becomes a
    ``_Ref``, so the buffer dies with the caller's leaves and backward re-gathers it (freed once the
    nodes that saved it have run). No gradient, no reduce-scatter, no prefetch."""
    if torch.compiler.is_dynamo_compiling():  # cfx.jit: a traced all-gather; the compiler decides what stays
        yield _gather_traced(src)
        return
    full = src.gather(backward=False)
    with RegatherHooks(src, full):
        yield src.layout.leaves_of_full(full)


def _inner_gathered(obj: Any, depth: int = 0) -> "Gathered | None":
    """The ``Gathered`` ``obj`` is or wraps (``cfx.remat(gathered(b))``), else None."""
    if isinstance(obj, Gathered):
        return obj
    if depth > 3 or isinstance(obj, type) or not dataclasses.is_dataclass(obj):
        return None
    for f in dataclasses.fields(obj):
        found = _inner_gathered(getattr(obj, f.name), depth + 1)
        if found is not None:
            return found
    return None


def sublayer_at(layer: Any, prefix: str) -> Any:
    """The sub-layer at a ``gathered_children`` prefix: ``blocks.3``, ``head``, or a path into a
    composite's sublayers (``down_blocks.0.resnets.1``)."""
    obj = layer
    for name in prefix.split("."):
        subs = getattr(obj, "_sublayers", None)
        if isinstance(obj, (list, tuple)):
            obj = obj[int(name)]
        elif isinstance(subs, dict) and name in subs:
            obj = subs[name]
        else:
            obj = getattr(obj, name)
    return obj


def gathered_children(layer: Any, prefix: str = "") -> list[str]:
    """Param path prefixes owned by gathered sub-layers (see the module doc): in ``layer``'s
    dataclass fields, and in the sublayers a composite keeps (``keep_sublayers``; their names are
    its params' keys), looked for through the composites that are not gathered themselves."""
    entries = [(f.name, getattr(layer, f.name), False) for f in dataclasses.fields(layer)] \
        if dataclasses.is_dataclass(layer) else []
    subs = getattr(layer, "_sublayers", None)
    entries += [(k, v, True) for k, v in subs.items()] if isinstance(subs, dict) else []
    out = []
    for name, v, inside in entries:
        path = f"{prefix}{name}"
        items = [(f"{path}.{i}", x) for i, x in enumerate(v)] if isinstance(v, (tuple, list)) else [(path, v)]
        for p, item in items:
            if _inner_gathered(item) is not None:
                out.append(p)
            elif inside and isinstance(getattr(item, "_sublayers", None), dict):
                out += gathered_children(item, p + ".")
    return out


def _under(path: str, prefixes: list[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """``layer`` whose own params are gathered around each use (see the module doc)."""

    layer: Any
    axis: str = "data"
    prefetch: bool = True
    fp8_grads: bool = False  # its gradients reduce-scattered as e5m2 casts (``fp8_reduce.py``)

    def init(self, key: torch.Tensor) -> Any:
        return self.layer.init(key)

    def axes(self) -> Any:
        return self.layer.axes()

    def apply(self, params: Any, *args, **kwargs) -> Any:
        return self._call(self.layer.apply, params, args, kwargs)

    def apply_with_stats(self, params: Any, *args, **kwargs) -> Any:
        """``layer.apply_with_stats`` (an MoE block's: its output and router statistics), gathered."""
        return self._call(self.layer.apply_with_stats, params, args, kwargs)

    def loss(self, params: Any, *args, **kwargs) -> Any:
        """``layer.loss`` (a model's) with this layer's own params gathered."""
        return self._call(self.layer.loss, params, args, kwargs)

    def parts(self) -> Any:
        """The wrapped model's parts protocol with this layer's own params gathered around the
        embedding and around the head (each stage of a pipeline gathers what it runs)."""
        inner = self.layer.parts()
        return dataclasses.replace(
            inner, embed=lambda p, tokens: self._call(inner.embed, p, (tokens,), {}),
            head_loss=lambda p, x, targets: self._call(inner.head_loss, p, (x, targets), {}))

    def __getattr__(self, name: str) -> Any:  # config, blocks, ... of the wrapped layer
        if name.startswith("__") or name == "layer":
            raise AttributeError(name)
        return getattr(self.layer, name)

    def _call(self, fn, params, args, kwargs):
        tree = params.sharded_leaves() if isinstance(params, ZeroParams) else params
        items, treedef = tree_util.flatten_with_path(tree)
        children = gathered_children(self.layer)
        own = [i for i, (p, x) in enumerate(items) if isinstance(x, ShardedLeaf) and not _under(p, children)]
        fp8 = getattr(self.layer, "gathered_in_fp8", None) or {}  # (a Float8Layer's weights: fp8_gather.py)
        cast = [i for i in own if items[i][0] in fp8]
        own = [i for i in own if items[i][0] not in fp8]
        if not own and not cast:
            return fn(tree, *args, **kwargs)
        leaves = [x for _, x in items]
        if not own:
            with self._float8_group(items, cast, fp8, leaves):
                return fn(tree_util.unflatten(treedef, leaves), *args, **kwargs)
        src = self._source([items[i] for i in own])
        if torch.compiler.is_dynamo_compiling():  # inside cfx.jit: the compiler decides what backward keeps
            if cast:
                raise ValueError("cfx.zero.gathered: a float8 all-gather runs eagerly; compile without it.")
            for i, view in zip(own, _gather_traced(src)):
                leaves[i] = view
            return fn(tree_util.unflatten(treedef, leaves), *args, **kwargs)
        # one autograd node per leaf after the shared gather: a zero-bubble W reaching one weight
        # must not run through the other nodes that share the gather (pipeline/backward.py)
        # deferred only where nothing in backward reads the pieces' gradients: they are the leaves
        # autograd.grad returns (no cast in between, no accumulation into .grad)
        step = prefetch.current() if type(src) is ShardSource else None
        src.deferred = step is not None and all(p.grad_fn is None for p in src.inputs())
        if step is not None and in_backward():
            step = None  # a remat recompute is no step of forward: nothing to prefetch
        # the step's outermost gathered layer (the model's root) runs through the whole forward
        # and its backward starts where forward ends: what backward reads of its params stays
        # gathered for it instead of being freed and gathered again at once (FSDP's root) -- unless
        # it runs under a remat region's hooks (a model whose first gathered layer is a block, as
        # LoRA's adapters-only model): remat's recompute replays no root, so it is an ordinary layer
        root = (step is not None and not step.order
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)
        if step is not None:
            src.prefetch = self.prefetch and not root
            src._started = step.take(src.pieces)
            src.before = step.order[-1] if step.order else None
            step.order.append(src)
        views = [v.view_as(v) for v in GatherFn.apply(src, *src.inputs())]
        if step is not None:
            step.then(src.pieces)
            step.expect(self._child_groups(items, children))
        for i, view in zip(own, views):
            leaves[i] = view
        with contextlib.nullcontext() if root else RegatherHooks(src, views[0]):
            with self._float8_group(items, cast, fp8, leaves) if cast else contextlib.nullcontext():
                out = fn(tree_util.unflatten(treedef, leaves), *args, **kwargs)
        src.after_forward()
        return out

    def _float8_group(self, items: list, cast: list[int], fp8: dict, leaves: list) -> RegatherHooks:
        """The layer's float8 weights (``cast``, indices into ``items``) all-gathered as their e4m3 casts into
        ``leaves`` (``fp8_gather.py``); the hooks that free and re-gather their buffer around the layer's run."""
        own = [items[i] for i in cast]
        plain = self._source(own)
        src = Float8Source(plain.layout, self.axis, plain.pieces, plain.dtype, over_axes(self.axis, fp8.values()))
        src.fp8_grads = self.fp8_grads
        stand_ins = GatherFp8Fn.apply(src, *src.inputs())
        for i, w, w8, scale in zip(cast, stand_ins, src.cast, src.scales):
            leaves[i] = self.layer.gathered_weight(items[i][0], w, w8, scale)
        return RegatherHooks(src, src.cast[0])

    def _child_groups(self, items: list, children: list[str]) -> list[tuple[list[torch.Tensor], str]]:
        """What the gathered children will gather, in order: each child's plain pieces and axis,
        up to the first child whose group cannot be told from here (one with gathered children
        of its own, or offloaded pieces)."""
        groups = []
        for prefix in children:
            inner = _inner_gathered(sublayer_at(self.layer, prefix))
            if inner is None or not inner.prefetch or gathered_children(inner.layer):
                break
            fp8 = getattr(inner.layer, "gathered_in_fp8", None) or {}  # (gathered apart, in float8: no prefetch)
            own = [x for p, x in items if isinstance(x, ShardedLeaf) and _under(p, [prefix])
                   and p[len(prefix) + 1:] not in fp8]
            if not own or any(x.source is not None for x in own):
                break
            groups.append(([x.piece for x in own], inner.axis))
        return groups

    def _source(self, own: list[tuple[str, ShardedLeaf]]) -> ShardSource:
        n = lax.axis_size(self.axis)
        layout = GroupLayout(tuple(p for p, _ in own), tuple(x.shape for _, x in own), n)
        first = own[0][1]
        if any(x.source is not first.source for _, x in own):  # (identity, not id(): dynamo traces it)
            raise ValueError("cfx.zero.gathered: the params of one gathered layer come from more than one "
                             "place (pieces and Gemini chunks mixed); pass params made one way.")
        if first.source is not None:
            return first.source.for_layout(layout, self.axis, [x.piece for _, x in own])
        for (path, x), k in zip(own, layout.pieces):
            if x.n != n or x.piece.numel() != k:
                raise ValueError(f"cfx.zero.gathered: param {path!r} was sharded over {x.n} ranks "
                                 f"(piece of {x.piece.numel()} elements) but axis {self.axis!r} has {n} "
                                 f"ranks here (pieces of {k}); re-shard with cfx.zero.shard_params on "
                                 "this mesh.")
        src = ShardSource(layout, self.axis, [x.piece for _, x in own], own[0][1].piece.dtype)
        src.fp8_grads = self.fp8_grads
        return src


def _gather_traced(src: ShardSource) -> list[torch.Tensor]:
    """The group's leaves, gathered by a differentiable all-gather (its transpose reduce-scatters
    the gradient) for ``torch.compile`` to trace: the eager path's saved-tensor hooks are not
    traceable, and a compiled graph's backward keeps (or recomputes) what its partitioner says."""
    if type(src) is not ShardSource:
        raise ValueError("cfx.zero.gathered: offloaded ZeRO-3 params (Gemini chunks, host or NVMe tiers) "
                         "cannot be compiled with cfx.jit; run the step eagerly (compile=False) or keep the "
                         "pieces on the device.")
    shard = concat_flat(src.pieces)                        # (S,)
    rows = lax.all_gather(_MeanGrad.apply(shard, src.axis), src.axis, dim=0, tiled=False)  # (n, S)
    return src.layout.leaves_of_full(src.layout.full_from_rows(rows))


class _MeanGrad(torch.autograd.Function):
    """The identity; its backward divides the gradient by the size of ``axis`` (after the
    all-gather's transpose summed it over the axis: the mean, as the eager backward gives)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.n = lax.axis_size(axis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.n, None


def gathered(layer: Any, *, axis: str = "data", prefetch: bool = True, fp8_grads: bool = False) -> Gathered:
    """``layer`` as a ZeRO-3 layer over mesh axis ``axis`` (see the module doc). ``prefetch``:
    inside ``ztx.value_and_grad`` its gathers may start while the layer before it (forward) or
    after it (backward) computes, holding one more layer gathered (``prefetch.py``). ``fp8_grads``:
    its gradients reduce-scattered as e5m2 casts, an all-to-all summed in fp32 (``fp8_reduce.py``; lossy)."""
    if not all(callable(getattr(layer, a, None)) for a in ("init", "apply", "axes")):
        raise ValueError(f"cfx.zero.gathered: {type(layer).__name__} is not a layer (needs init, apply "
                         "and axes); wrap a block or a model.")
    return Gathered(layer, axis, bool(prefetch), bool(fp8_grads))
