"""Helpers shared by the optimizer transformations: leaf lists, state init, argument checks.

Transformations work on flat leaf lists with ``torch._foreach_*`` ops (one multi-tensor kernel
per op on CUDA). They never write into their inputs; an in-place ``_foreach_*_`` op is only ever
applied to a tensor created a few lines earlier in the same function.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.optim import reduction

PyTree = Any


def leaves_like(what: str, tree: PyTree, treedef: tree_util.PyTreeDef, ref: PyTree) -> list[Any]:
    """``tree``'s leaves, after checking that ``tree`` has ``ref``'s structure ``treedef``."""
    xs = tree_util.leaves_as(tree, treedef)  # the usual case, in a fraction of a flatten's time
    if xs is not None:
        return xs
    xs, td = tree_util.flatten(tree)
    check_structure(what, ref, treedef, tree, td)
    return xs


def check_structure(what: str, ref: PyTree, ref_treedef: tree_util.PyTreeDef, tree: PyTree,
                    treedef: tree_util.PyTreeDef) -> None:
    """``leaves_like``'s check for a tree already flattened: ``tree`` (``treedef``) must have
    ``ref``'s structure ``ref_treedef``."""
    if treedef != ref_treedef:
        tree_util.check_same_structure(what, ref, tree)  # raises, naming the differing paths
        raise ValueError(f"{what}: structures differ: {ref_treedef} vs {treedef}.")  # pragma: no cover


def first_device(tree: PyTree) -> torch.device:
    for x in tree_util.leaves(tree):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def zero_count(params: PyTree) -> torch.Tensor:
    """A 0-d int32 step counter on the params' device (a tensor, so checkpoints can save it)."""
    return torch.zeros((), dtype=torch.int32, device=first_device(params))


def zeros_like_tree(where: str, params: PyTree) -> PyTree:
    """Zero moments shaped like ``params``, which must be floating (ValueError naming the leaf)."""
    for path, p in tree_util.flatten_with_path(params)[0]:
        if not (p.is_floating_point() or p.is_complex()):
            raise ValueError(f"cfx.optim ({where}): param {path or '<root>'!r} is {p.dtype}; its moments need a "
                             "floating dtype. Cast it (x.float()), or keep integer state out of the tree "
                             "the optimizer updates.")
    return tree_util.map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)


def bias_correction(decay: float, count: torch.Tensor) -> torch.Tensor:
    """``1 - decay ** count`` as a float32 0-d tensor, computed as ``-expm1(count * log(decay))``.

    ``1 - decay ** count`` in float32 loses ~5e-5 relative accuracy for ``decay = 0.999``;
    the ``expm1`` form is accurate to float32 rounding.
    """
    if decay == 0.0:
        return torch.ones((), dtype=torch.float32, device=count.device)
    return -torch.expm1(count.to(torch.float32) * math.log(decay))


def leaf_norms_global(xs: list[torch.Tensor], idx: list[int], n_leaves: int, where: str) -> torch.Tensor:
    """The L2 norm of each of ``xs`` (leaves ``idx`` of a tree of ``n_leaves``), float32 (k,),
    across the shards of a ``cfx.optim.sharded`` step (``reduction``)."""
    norms = torch.stack(leaf_norms(xs))
    if not reduction.is_sharded():
        return norms
    return reduction.leaf_sq_sums(norms.square(), idx, n_leaves, where).sqrt()


def leaf_norms(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each floating-point tensor, accumulated and returned in float32 (0-d
    tensors on the first tensor's device, ready to stack)."""
    device = xs[0].device
    wide = {i for i, x in enumerate(xs) if x.dtype == torch.float64}
    narrow = [x for i, x in enumerate(xs) if i not in wide]
    it_narrow = iter(torch._foreach_norm(narrow, 2, dtype=torch.float32) if narrow else [])
    it_wide = iter(torch._foreach_norm([xs[i] for i in sorted(wide)], 2) if wide else [])
    norms = [next(it_wide).float() if i in wide else next(it_narrow) for i in range(len(xs))]
    return [n if n.device == device else n.to(device, non_blocking=True) for n in norms]


def as_scalar(value: Any, device: torch.device) -> Any:
    """A Python number stays as is; a 0-d tensor is moved to ``device`` (no host sync)."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def resolve_mask(what: str, mask: Any, params: PyTree, n: int) -> list[bool] | None:
    """``mask`` (a pytree of bools like params, or ``params -> such a pytree``) as a flat list."""
    if mask is None:
        return None
    if params is None:
        raise ValueError(f"{what}: a mask needs the params; call tx.update(grads, state, params).")
    tree = mask(params) if callable(mask) else mask
    tree_util.check_same_structure(f"{what} (mask vs params)", params, tree)
    flags = tree_util.leaves(tree)
    assert len(flags) == n
    for (path, f) in tree_util.flatten_with_path(tree)[0]:
        if not isinstance(f, bool):
            raise ValueError(f"{what}: mask leaf {path or '<root>'!r} is a {type(f).__name__}; mask "
                             "leaves must be Python bools (True where the rule applies).")
    return flags


# ---- argument checks: ValueError saying what is wrong and how to fix it ----------------------

def check_learning_rate(fn: str, lr: Any) -> None:
    if callable(lr) or isinstance(lr, torch.Tensor):
        return
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool):
        raise ValueError(f"cfx.optim.{fn}: learning_rate must be a float or a schedule "
                         f"(step -> lr), got {type(lr).__name__}.")
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"cfx.optim.{fn}: learning_rate={lr} must be a finite number >= 0; the "
                         "descent sign is applied internally, so pass a positive step size.")


def check_nonneg(fn: str, name: str, value: Any, hint: str = "") -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"cfx.optim.{fn}: {name}={value!r} must be a finite number >= 0"
                         + (f"; {hint}" if hint else "") + ".")


def check_beta(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"cfx.optim.{fn}: {name}={value!r} must be in [0, 1); typical values "
                         "are 0.9 for b1 and 0.95-0.999 for b2.")


def check_positive(fn: str, name: str, value: Any, hint: str = "") -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"cfx.optim.{fn}: {name}={value!r} must be a finite number > 0"
                         + (f"; {hint}" if hint else "") + ".")

