"""``remat``: activation checkpointing through one saved-tensor-hook engine.

While ``f`` runs, every tensor autograd saves for backward passes through one pack hook, which
asks the policy where it goes: kept on device, offloaded to host (copied back on first use), or
dropped and recomputed. The first backward use of a dropped tensor re-runs ``f`` on the same
inputs (with grad recording on, so the same ops save the same tensors in the same order) and
hands back the recomputed values by position. ``f``'s inputs are always kept.

Inside ``torch.compile`` (``cfx.jit``) the hooks cannot run: the policy is asked per op through
torch's selective checkpointing and the compiler recomputes what it says to recompute (``_compiled``).

Randomness is explicit (dropout takes keys), so a recomputed forward replays it exactly.
Collectives inside ``f`` run again in the recomputation, at the same point on every rank,
because every rank's backward reaches it symmetrically; to avoid re-issuing one, save its
output with ``cfx.checkpoint_name`` and a policy that keeps that name.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.weak import WeakIdKeyDictionary

from cfx._src.core import context, tree as tree_util
from cfx._src.remat import policies as pol
from cfx._src.transforms.autodiff import TRACES_GRAD_WITH_FUNC
from cfx._src.core.text import format_table

_names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> checkpoint name
_DOTS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
         torch.nn.functional.linear, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm,
         torch.Tensor.bmm, torch.Tensor.addmm}
_calls = itertools.count()
_collectors = context.Collectors("cfx_activation_stats")


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x``, tagged ``name`` for remat policies (``save_only_these_names`` etc.; not seen inside
    torch.compile, see ``_compiled``)."""
    if torch.compiler.is_dynamo_compiling():
        return x
    y = x.view_as(x)
    _names[y] = name
    return y


class _DotTagger(TorchFunctionMode):
    """Marks the outputs of matmul-family calls, for ``dots_saveable``."""

    def __init__(self, dots: WeakIdKeyDictionary):
        super().__init__()
        self.dots = dots

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _DOTS and isinstance(out, torch.Tensor):
            self.dots[out] = True
        return out


@dataclasses.dataclass(frozen=True)
class SavedRecord:
    call: int
    name: str | None
    tier: str      # "device" (kept), "host" (offloaded), "recomputed" (dropped)
    nbytes: int
    shape: tuple[int, ...]


class ActivationStats(context.Collector):
    """Bytes saved for backward by remat-wrapped calls inside ``with cfx.activation_stats():``."""

    stack = _collectors

    def __init__(self):
        self.records: list[SavedRecord] = []
        self.chain_peaks: list[tuple[str, int]] = []  # (schedule name, measured peak bytes) per chain run

    def bytes(self, *, tier: str | None = None, name: str | None = None, call: int | None = None) -> int:
        return sum(r.nbytes for r in self.records if (tier is None or r.tier == tier)
                   and (name is None or r.name == name) and (call is None or r.call == call))

    def table(self) -> str:
        agg: dict[tuple, list[int]] = {}
        for r in self.records:
            key = (r.call, r.name or "-", r.tier)
            agg.setdefault(key, [0, 0])
            agg[key][0] += 1
            agg[key][1] += r.nbytes
        rows = [(*k, n, b) for k, (n, b) in sorted(agg.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))]
        return format_table(rows, ["call", "name", "tier", "tensors", "bytes"])



def activation_stats() -> ActivationStats:
    return ActivationStats()


class _Recomputation:
    """Re-runs ``f`` on first need and serves the saved tensors by pack position, each handed out
    once: autograd unpacks a saved tensor once per backward, and the graph's nodes (with the
    hooks that reach this object) live until the whole backward ends, so a value kept after its
    use would keep every recomputed block alive at once. A second backward through a retained
    graph finds its values gone and recomputes again."""

    def __init__(self, f, args, kwargs, needed: set[int]):
        self.f, self.args, self.kwargs, self.needed = f, args, kwargs, needed
        self.values: dict[int, torch.Tensor] = {}

    def get(self, index: int) -> torch.Tensor:
        if index not in self.values:
            self._run()
        return self.values.pop(index)

    def _run(self) -> None:
        values: dict[int, torch.Tensor] = {}
        counter = itertools.count()

        def pack(t):
            i = next(counter)
            if i in self.needed:
                values[i] = t
            return None

        args = tree_util.map(lambda x: x.detach().requires_grad_(x.requires_grad)
                             if isinstance(x, torch.Tensor) else x, self.args)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), \
                _DotTagger(WeakIdKeyDictionary()):
            self.f(*args, **self.kwargs)
        self.values = values


@dataclasses.dataclass(frozen=True)
class RematLayer:
    """A layer whose ``apply`` is rematerialised; same ``init`` / ``axes`` as the wrapped layer."""

    layer: Any
    policy: Any = pol.nothing_saveable

    def init(self, key):
        return self.layer.init(key)

    def axes(self):
        return self.layer.axes()

    def apply(self, params, *args, **kwargs):
        return remat(self.layer.apply, policy=self.policy)(params, *args, **kwargs)

    def apply_with_stats(self, params, *args, **kwargs):
        """``layer.apply_with_stats`` (an MoE block's), rematerialised the same way."""
        return remat(self.layer.apply_with_stats, policy=self.policy)(params, *args, **kwargs)


def _is_layer(x: Any) -> bool:
    return all(callable(getattr(x, a, None)) for a in ("init", "apply", "axes"))


def remat(f: Callable[..., Any] | None = None, *, policy: pol.Policy = pol.nothing_saveable):
    """``f`` whose forward keeps only what ``policy`` saves; backward recomputes the rest.

    ``f`` is a function or a layer (an object with ``init`` / ``apply`` / ``axes``, which gives
    a ``RematLayer``: ``model.map_blocks(lambda b: cfx.remat(b, policy=...))``). Also usable as
    a decorator ``@cfx.remat(policy=...)``.
    """
    if f is None:
        return functools.partial(remat, policy=policy)
    if not callable(policy):
        raise ValueError(f"cfx.remat: policy must be callable (Saved -> 'save'|'recompute'|'offload'), "
                         f"got {policy!r}.")
    if _is_layer(f):
        return RematLayer(f, policy)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return f(*args, **kwargs)  # nothing is saved without grad
        if torch.compiler.is_dynamo_compiling():
            return _compiled(f, policy, args, kwargs)
        call = next(_calls)
        collectors = _collectors.active()
        inputs = [x for x in tree_util.leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        input_storages = {id(x.untyped_storage()) for x in inputs}  # alive: args hold them
        dots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        counter = itertools.count()
        needed: set[int] = set()
        counted: dict[int, weakref.ref] = {}
        recomputation = _Recomputation(f, args, kwargs, needed)

        def pack(t: torch.Tensor):
            i = next(counter)
            storage = t.untyped_storage()
            if id(storage) in input_storages:
                return ("keep", t)  # f's inputs (and views of them, e.g. a transposed weight)
            nbytes = t.numel() * t.element_size()
            is_dot = t in dots or (t._base is not None and t._base in dots)  # a view of a matmul output
            info = pol.Saved(tuple(t.shape), t.dtype, nbytes, is_dot, _names.get(t))
            seen = counted.get(id(storage))
            if seen is not None and seen() is storage:  # saved again (q, k, v share an input): count once
                nbytes = 0
            counted[id(storage)] = weakref.ref(storage)  # identity, not address: addresses get reused
            decision = policy(info)
            if decision not in pol.DECISIONS:
                raise ValueError(f"cfx.remat: the policy returned {decision!r}; expected one of {pol.DECISIONS}.")
            tier = {"save": "device", "offload": "host", "recompute": "recomputed"}[decision]
            for c in collectors:
                c.records.append(SavedRecord(call, info.name, tier, nbytes, info.shape))
            if decision == pol.SAVE:
                return ("keep", t)
            if decision == pol.OFFLOAD:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                host.copy_(t, non_blocking=t.is_cuda)
                return ("host", host, t.device)
            needed.add(i)
            return ("recompute", i)

        def unpack(handle):
            kind = handle[0]
            if kind == "keep":
                return handle[1]
            if kind == "host":
                return handle[1].to(handle[2], non_blocking=True)
            return recomputation.get(handle[1])

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _DotTagger(dots):
            return f(*args, **kwargs)

    return wrapped


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def _compiled(f: Callable[..., Any], policy: pol.Policy, args: tuple, kwargs: dict) -> Any:
    """``remat`` inside torch.compile, where saved-tensor hooks cannot run: torch's selective
    checkpointing asks the policy per op, and the compiler honours its answer -- "recompute"
    recomputes, "save" and "offload" save (a compiled graph does not offload). The policy sees
    whether the op is a matmul and its dtype; names and sizes are not known per op here (``name``
    None, ``nbytes`` 0)."""
    if TRACES_GRAD_WITH_FUNC:
        raise ValueError(f"cfx.remat inside cfx.jit needs torch 2.12 or later (this is {torch.__version__}, whose "
                         "compiled gradients go through torch.func, which checkpointing cannot run under); drop "
                         "the remat policy from the jitted step, or run the step eagerly (cfx.jit(..., "
                         "compile=False)), where remat works on any torch.")
    contexts = functools.partial(create_selective_checkpoint_contexts, functools.partial(_decide, policy))
    return checkpoint(f, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _decide(policy: pol.Policy, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return CheckpointPolicy.MUST_SAVE  # random (or uninitialised) values cannot be made again
    dtype = next((x.dtype for x in args if isinstance(x, torch.Tensor)), torch.float32)
    decision = policy(pol.Saved((), dtype, 0, op in _MATMULS, None))
    return CheckpointPolicy.PREFER_RECOMPUTE if decision == pol.RECOMPUTE else CheckpointPolicy.MUST_SAVE
