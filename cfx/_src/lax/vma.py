"""Varying mesh axes: JAX's ``vma`` typing of the values inside a ``shard_map`` body.

A value *varies* over a mesh axis when ranks along it may hold different values; otherwise it is
*invariant* (the same on every rank of the axis). Inputs vary over the axes their in_spec names;
constants made in the body vary over nothing; an op's result varies over the union of its
operands' axes; the collectives change it (``psum`` removes its axes, ``pvary``, ``all_gather``,
``psum_scatter``, ``all_to_all`` and ``ppermute`` add theirs), and a gradient (the result of
``torch.autograd.grad``, so of ``cfx.grad``) varies over exactly the axes of its primal, as in
JAX's ``shard_map`` with ``check_vma=True``. ``cfx.lax.varying_axes(x)`` reads it.

Tracking costs a Python hook per op, so it is on where it is needed: in bodies differentiated from
outside and in ``shard_map(..., check_vma=True)``; elsewhere ``varying_axes`` raises.

It matters for gradients: where an invariant value meets a varying one, JAX implicitly ``pvary``s
the invariant operand, so its cotangent -- which then differs per rank -- is ``psum``'d back into
an invariant one. A tracking body does the same: every op whose differentiable operands disagree
gets those implicit ``pvary``s (one per leaf input per axis set, however often the input is
used), so a gradient of an invariant value comes out invariant, summed over the axes it met, both
from outside the ``shard_map`` and from a ``cfx.grad`` inside the body (JAX's ``check_vma=True``).
A body that does not track (``check_vma=False``, not differentiated from outside) inserts
nothing: a ``cfx.grad`` inside it returns each rank's own partial gradients, to be reduced
explicitly (which is what lets data parallelism bucket its all-reduce), as JAX's
``check_vma=False`` does -- but the explicit collectives keep the transposes above (``psum``'s is
the identity), where JAX's ``check_vma=False`` transposes a ``psum`` to a ``psum``.

Values whose variation comes from Python (``axis_index`` turned into a tensor, a key folded with
it) are not seen; wrap them in ``cfx.lax.pvary`` to say so.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from cfx._src.core import context
from cfx._src.lax import comm, groups

EMPTY: frozenset = frozenset()
_ATTR = "_cfx_vma"
_tracker: context.Var["_Tracking | None"] = context.Var("cfx_vma", None, semantic="a shard_map body tracking varying axes")


def varying_axes(x) -> frozenset:
    """The mesh axes over which ``x`` may differ between ranks (as tagged; see ``checked``)."""
    return getattr(x, _ATTR, EMPTY) if isinstance(x, torch.Tensor) else EMPTY


def checked_varying_axes(x) -> frozenset:
    """``varying_axes`` for users: a ValueError where this thread does not track them."""
    if _tracker.get() is None:
        raise ValueError("cfx.lax.varying_axes: varying axes are tracked inside shard_map bodies that are "
                         "differentiated from outside, or called with shard_map(..., check_vma=True); "
                         "this value was not made in one.")
    return varying_axes(x)


def is_tracking() -> bool:
    """True inside a ``shard_map`` body that tracks varying axes (and inserts implicit pvarys)."""
    return _tracker.get() is not None


def mark(x: torch.Tensor, axes) -> torch.Tensor:
    """Tag ``x`` as varying over exactly ``axes``; returns ``x``."""
    setattr(x, _ATTR, frozenset(axes))
    return x


def declare_varying(x, axes) -> torch.Tensor:
    """Where this thread tracks: ``x`` typed (in place) as also varying over ``axes``, with no
    pvary -- for a value that differs per rank by construction (this rank's own copy of a param
    whose gradient its caller reduces explicitly, a shard cut by ``axis_index``); returns ``x``."""
    if _tracker.get() is not None and isinstance(x, torch.Tensor):
        mark(x, varying_axes(x) | frozenset(axes))
    return x


class PVary(torch.autograd.Function):
    """Identity on values; the transpose sums cotangents over the axes (``psum``)."""

    @staticmethod
    def forward(ctx, x, ax):
        ctx.ax = ax
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.ax, "sum"), None


def lift(x: torch.Tensor, axes: frozenset, where: str) -> torch.Tensor:
    """``x`` made varying over ``axes`` too, by an implicit ``pvary`` (shared per leaf input)."""
    missing = axes - varying_axes(x)
    if not missing:
        return x
    target = varying_axes(x) | missing
    tracker = _tracker.get()
    key = (id(x), target)
    cache = tracker.lifted if tracker is not None and x.grad_fn is None else None  # leaf inputs only
    if cache is not None and key in cache:
        return cache[key][1]
    out = mark(PVary.apply(x, groups.axes(tuple(sorted(missing)), where)), target)
    if cache is not None:
        cache[key] = (x, out)  # x kept alive with its entry, so its id is not reused meanwhile
    return out


def _scan(xs, union):
    for a in xs:
        if isinstance(a, torch.Tensor):
            v = getattr(a, _ATTR, EMPTY)
            if v:
                union = union | v
        elif isinstance(a, (list, tuple)):
            union = _scan(a, union)
    return union


def _lift_all(xs, union):
    out = []
    for a in xs:
        if isinstance(a, torch.Tensor):
            if a.requires_grad and getattr(a, _ATTR, EMPTY) != union:
                a = lift(a, union, "an implicit pvary")
        elif isinstance(a, (list, tuple)) and a:
            a = type(a)(_lift_all(a, union)) if isinstance(a, list) or type(a) is tuple else a
        out.append(a)
    return out


def _tag(out, union) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, _ATTR, union | getattr(out, _ATTR, EMPTY))
    elif isinstance(out, (list, tuple)):
        for o in out:
            _tag(o, union)


def _typed_grads(grads, inputs) -> tuple:
    """``torch.autograd.grad``'s results typed as in JAX: a cotangent varies over its primal's axes."""
    out = []
    for g, x in zip(grads, inputs):
        if isinstance(g, torch.Tensor):
            want = varying_axes(x)
            if getattr(g, _ATTR, want) != want:  # one tensor returned for two inputs of two types
                g = g.view_as(g)
            mark(g, want)
        out.append(g)
    return tuple(out)


class _Tracking(TorchFunctionMode):
    """Tags every op's tensor results with the union of its operands' varying axes, after lifting
    differentiable operands that vary over fewer axes (implicit pvarys, module doc); gradients
    get their primals' types."""

    def __init__(self):
        super().__init__()
        self.lifted: dict = {}  # (id(leaf), axes) -> (leaf, its lifted value), for this body call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad:  # (outputs, inputs, ...): differentiate what was used, unlifted
            inputs = args[1] if len(args) > 1 else kwargs["inputs"]
            return _typed_grads(func(*args, **kwargs), inputs)
        union = _scan(args, EMPTY)
        if kwargs:
            union = _scan(kwargs.values(), union)
        if not union:
            return func(*args, **kwargs)
        if torch.is_grad_enabled():
            args = _lift_all(args, union)
            if kwargs:
                kwargs = dict(zip(kwargs, _lift_all(kwargs.values(), union)))
        out = func(*args, **kwargs)
        if out is None and func is torch.Tensor.__setitem__:
            _tag(args[0], union)
        else:
            _tag(out, union)
        return out


@contextlib.contextmanager
def tracking():
    """Track varying axes in this thread (a ``shard_map`` body), with implicit pvarys."""
    mode = _Tracking()
    token = _tracker.set(mode)
    try:
        with mode:
            yield
    finally:
        _tracker.reset(token)
        mode.lifted.clear()
