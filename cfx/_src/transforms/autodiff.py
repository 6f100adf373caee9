"""Autodiff transforms: ``grad`` / ``value_and_grad`` over pytrees, plus ``vmap`` / ``jvp``.

``grad`` differentiates with ``torch.autograd.grad`` over the leaf tensors of the chosen
arguments -- not ``torch.func.grad`` -- so saved-tensor hooks (remat, offload) and
``torch.utils.checkpoint`` keep working inside the differentiated function.

Leaves that are not tensors but implement the differentiable-leaf protocol (``ShardedArray``:
``__cfx_grad_leaf__``, ``__cfx_anchor__``, ``__cfx_seed__``, ``__cfx_cotangent__``,
``__cfx_detached__``) are differentiated too; their gradients come back as the same kind of leaf.
"""
from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import _engine_run_backward  # (torch.autograd.grad's own engine call)

from cfx._src.core import tree as tree_util, tree_recurring


def _is_array_leaf(x: Any) -> bool:
    return hasattr(type(x), "__cfx_grad_leaf__")


def _diff_leaf(path: str, x: Any, fname: str, argnum: int) -> Any:
    if _is_array_leaf(x) and x.dtype.is_floating_point:
        return x.__cfx_grad_leaf__()
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
        kind = type(x).__name__ if not isinstance(x, torch.Tensor) else f"tensor of dtype {x.dtype}"
        raise ValueError(
            f"cfx.{fname}: argument {argnum} leaf {path or '<root>'!r} is a {kind}; only floating-point "
            "tensors can be differentiated. Move it to another argument, or choose argnums that "
            "exclude it.")
    if x.requires_grad:
        # Inside an outer grad: keep the connection so higher-order derivatives flow.
        return x.view_as(x)
    return x.detach().requires_grad_(True)


def _plain_floats(xs: list) -> bool:
    """Every leaf a floating tensor of the plain class, outside any grad: ``_diff_leaf`` would
    detach each and make it require grad, with nothing to check."""
    if torch.compiler.is_dynamo_compiling():
        return False  # traced: the general path, leaf by leaf
    return (set(map(type, xs)) <= _PLAIN and all(map(torch.Tensor.is_floating_point, xs))
            and not any(map(_requires_grad, xs)))


_PLAIN = {torch.Tensor}
_requires_grad = operator.attrgetter("requires_grad")
_tensor_detach, _requires_grad_ = torch.Tensor.detach, torch.Tensor.requires_grad_
_has_torch_function = torch._C._has_torch_function  # (a mode counts: what torch.autograd.grad asks)

# torch 2.11's dynamo cannot trace ``requires_grad_`` on a tensor made in the graph (later ones do;
# ``trace_autograd_ops`` then traces ``torch.autograd.grad``): there ``cfx.jit`` differentiates
# through ``torch.func`` instead (``_traced``)
TRACES_GRAD_WITH_FUNC = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)


def _grad(root: torch.Tensor, leaves: list[torch.Tensor], create_graph: bool) -> tuple:
    """``torch.autograd.grad(root, leaves, allow_unused=True, create_graph=...)`` for a scalar
    ``root`` and plain tensor ``leaves`` made here: the engine call it makes, without its Python
    checks per input (a few microseconds a leaf, every step). A root of another class, a torch
    function mode (``shard_map``'s varying-axes typing), or code being compiled goes through
    ``torch.autograd.grad`` itself."""
    if type(root) is not torch.Tensor or _has_torch_function((root,)) or torch.compiler.is_dynamo_compiling():
        return torch.autograd.grad(root, leaves, allow_unused=True, create_graph=create_graph)
    seed = torch.ones_like(root, memory_format=torch.preserve_format)  # d root / d root
    return _engine_run_backward((root,), (seed,), create_graph, create_graph, tuple(leaves), True, False)


def _check_scalar(out: Any, fname: str, has_aux: bool) -> torch.Tensor:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"cfx.{fname}(has_aux=True): the function must return (value, aux), "
                             f"got {type(out).__name__}.")
        out = out[0]
    if _is_array_leaf(out) and out.numel() == 1 and out.dtype.is_floating_point:
        return out
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
        got = (f"tensor of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor)
               else f"{type(out).__name__} of shape {out.shape}" if _is_array_leaf(out) else type(out).__name__)
        raise ValueError(f"cfx.{fname}: the function must return a scalar floating-point tensor "
                         f"(e.g. a mean loss), got {got}. Reduce it first, or take the Jacobian "
                         "(cfx.jacrev) or torch.autograd.grad with grad_outputs.")
    return out


# The last call's differentiated arguments' structures, shared by every value_and_grad: a train step
# differentiates the same structure every step, through a function it often wraps anew each step
# (``cfx.value_and_grad(model.loss)(params, ...)``). Another structure is flattened as usual.
_ARGUMENTS = tuple(tree_recurring.Recurring() for _ in range(4))


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, *,
                   has_aux: bool = False) -> Callable[..., Any]:
    """``fun``'s value and its gradient w.r.t. the pytree argument(s) ``argnums``.

    Returns ``(value, grads)`` or, with ``has_aux``, ``((value, aux), grads)``; ``grads`` has the
    structure of ``args[argnums]`` (a tuple of such trees when ``argnums`` is a sequence). Leaves
    that do not influence the value get zero gradients.
    """
    multi = not isinstance(argnums, int)
    nums = tuple(argnums) if multi else (argnums,)
    fname = "value_and_grad"

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ValueError(f"cfx.{fname}: argnums={argnums!r} but the function was called with "
                                 f"{len(args)} positional argument(s).")
        if (TRACES_GRAD_WITH_FUNC and torch.compiler.is_dynamo_compiling()) or _in_func_transform():
            traced = _traced(fun, args, kwargs, nums, has_aux, fname)
            if traced is not None:
                out, trees = traced
                return out, (trees if multi else trees[0])
        args = list(args)
        flat_inputs, treedefs, spans, plain = [], [], [], True
        for k, n in enumerate(nums):
            xs, treedef = _ARGUMENTS[k].flatten(args[n]) if k < len(_ARGUMENTS) else tree_util.flatten(args[n])
            if _plain_floats(xs):  # the usual case, in a few C-level passes
                leaves = list(map(_requires_grad_, map(_tensor_detach, xs)))
            else:
                items, treedef = tree_util.flatten_with_path(args[n])  # the paths, for errors
                leaves, plain = [_diff_leaf(p, x, fname, n) for p, x in items], False
            spans.append((len(flat_inputs), len(flat_inputs) + len(leaves)))
            flat_inputs.extend(leaves)
            treedefs.append(treedef)
            args[n] = tree_util.unflatten(treedef, leaves)
        nested = not plain and any(isinstance(x, torch.Tensor) and x.grad_fn is not None for x in flat_inputs)
        with torch.enable_grad():
            out = fun(*args, **kwargs)
        value = _check_scalar(out, fname, has_aux)
        targets = flat_inputs if plain else [x.__cfx_anchor__() if _is_array_leaf(x) else x for x in flat_inputs]
        if type(value) is not torch.Tensor and _is_array_leaf(value):
            root = value.__cfx_anchor__()
            if root is not None:
                value.__cfx_seed__()
        else:
            root = value
        if targets and root is not None and root.requires_grad:
            grads = list(_grad(root, targets, nested) if plain else
                         torch.autograd.grad(root, targets, allow_unused=True, create_graph=nested))
        else:
            grads = [None] * len(targets)
        if not plain or not all(map(isinstance, grads, itertools.repeat(torch.Tensor))):  # (unused leaves: None)
            grads = [x.__cfx_cotangent__() if _is_array_leaf(x) else torch.zeros_like(x) if g is None else g
                     for x, g in zip(flat_inputs, grads)]
        trees = (tree_util.unflatten(treedefs[0], grads),) if not multi else \
            tuple(tree_util.unflatten(td, grads[a:b]) for td, (a, b) in zip(treedefs, spans))
        if not nested:
            out = out.detach() if type(out) is torch.Tensor else tree_util.map(_detach, out)
        return out, (trees if multi else trees[0])

    return wrapped


def _in_func_transform() -> bool:
    """Inside a ``torch.func`` transform (``cfx.vmap``, ``cfx.jvp``, ``cfx.jacfwd``...): there a tensor may
    not be made to require grad, and ``torch.func.grad_and_value`` is what composes with the transform."""
    return torch._C._functorch.maybe_current_level() is not None


def _traced(fun: Callable[..., Any], args: tuple, kwargs: dict, nums: tuple, has_aux: bool,
            fname: str) -> tuple[Any, tuple] | None:
    """``value_and_grad`` through ``torch.func.grad_and_value`` over the differentiated leaves, so that
    no tensor is made to require grad: inside a ``torch.func`` transform (``cfx.vmap(cfx.grad(f))``,
    per-example gradients), and as dynamo traces it (``cfx.jit``) on a torch whose dynamo refuses
    ``requires_grad_`` in the graph (``TRACES_GRAD_WITH_FUNC``); None when a leaf is not a plain
    floating tensor outside any grad (the general path handles those). torch.func does not run
    saved-tensor hooks: a remat policy inside ``cfx.jit`` needs torch 2.12 or later."""
    flat, treedefs, spans = [], [], []
    for n in nums:
        xs, treedef = tree_util.flatten(args[n])
        if not all(type(x) is torch.Tensor and x.is_floating_point() and not x.requires_grad for x in xs):
            return None
        spans.append((len(flat), len(flat) + len(xs)))
        flat.extend(xs)
        treedefs.append(treedef)

    def of_leaves(*leaves):
        full = list(args)
        for n, td, (a, b) in zip(nums, treedefs, spans):
            full[n] = tree_util.unflatten(td, list(leaves[a:b]))
        out = fun(*full, **kwargs)
        return _check_scalar(out, fname, has_aux).reshape(()), out

    if not flat:
        return fun(*args, **kwargs), tuple(tree_util.unflatten(td, []) for td in treedefs)
    grads, (_, out) = torch.func.grad_and_value(of_leaves, argnums=tuple(range(len(flat))), has_aux=True)(*flat)
    return out, tuple(tree_util.unflatten(td, list(grads[a:b])) for td, (a, b) in zip(treedefs, spans))


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    return x.__cfx_detached__() if _is_array_leaf(x) else x


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, *,
         has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of scalar-valued ``fun`` w.r.t. ``args[argnums]`` (``(grads, aux)`` with has_aux)."""
    vg = value_and_grad(fun, argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        out, g = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped


def vmap(fun: Callable[..., Any], in_dims: Any = 0, out_dims: Any = 0, *, in_axes: Any = None,
         out_axes: Any = None, randomness: str = "error", chunk_size: int | None = None) -> Callable[..., Any]:
    """Vectorising map (``torch.func.vmap``); ``in_axes`` / ``out_axes`` are JAX's names for ``in_dims`` /
    ``out_dims``. Composes with ``cfx.grad`` / ``value_and_grad`` either way round:
    ``cfx.vmap(cfx.grad(loss), in_axes=(None, 0))(params, batch)`` gives per-example gradients."""
    if in_axes is not None:
        if in_dims != 0:
            raise ValueError("cfx.vmap: give in_dims (torch's name) or in_axes (JAX's), not both.")
        in_dims = in_axes
    if out_axes is not None:
        if out_dims != 0:
            raise ValueError("cfx.vmap: give out_dims (torch's name) or out_axes (JAX's), not both.")
        out_dims = out_axes
    return torch.func.vmap(fun, in_dims, out_dims, randomness=randomness, chunk_size=chunk_size)


def jacrev(fun: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False,
           chunk_size: int | None = None) -> Callable[..., Any]:
    """The Jacobian by reverse mode (``torch.func.jacrev``): for each output leaf, a pytree like
    ``args[argnums]`` of ``(*out.shape, *leaf.shape)`` blocks."""
    return torch.func.jacrev(fun, argnums, has_aux=has_aux, chunk_size=chunk_size)


def jacfwd(fun: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False,
           randomness: str = "error") -> Callable[..., Any]:
    """The Jacobian by forward mode (``torch.func.jacfwd``), laid out as ``jacrev``'s."""
    return torch.func.jacfwd(fun, argnums, has_aux=has_aux, randomness=randomness)


def hessian(fun: Callable[..., Any], argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
    """The Hessian of scalar-valued ``fun`` (``jacfwd(jacrev(fun))``, ``torch.func.hessian``)."""
    return torch.func.hessian(fun, argnums)


def jvp(fun: Callable[..., Any], primals: tuple, tangents: tuple, *, has_aux: bool = False):
    """Forward-mode Jacobian-vector product (``torch.func.jvp``): ``(out, tangent_out)``."""
    if not isinstance(primals, tuple) or not isinstance(tangents, tuple):
        raise ValueError("cfx.jvp: primals and tangents must be tuples (one entry per argument of fun).")
    if len(primals) != len(tangents):
        raise ValueError(f"cfx.jvp: got {len(primals)} primals but {len(tangents)} tangents.")
    for i, (p, t) in enumerate(zip(primals, tangents)):
        tree_util.check_same_structure(f"cfx.jvp (argument {i})", p, t)
    return torch.func.jvp(fun, primals, tangents, has_aux=has_aux)
