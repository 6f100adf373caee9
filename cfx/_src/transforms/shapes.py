"""``cfx.eval_shape``: the shapes and dtypes a function would return, without allocating."""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from cfx._src.core import tree as tree_util


class ArrayShape:
    """Sizes from ``shape`` and ``dtype``, as a tensor reports them (ShapeDtype, ShardedArray)."""

    __slots__ = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()


@dataclasses.dataclass(frozen=True)
class ShapeDtype(ArrayShape):
    """A leaf's abstract value: ``shape`` and ``dtype`` (JAX's ``ShapeDtypeStruct``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run on fake tensors: its output with every tensor leaf replaced by a
    ``ShapeDtype``. Arguments may be tensors, ``ShapeDtype`` s or ShardedArrays (their global
    shape); nothing is allocated or computed."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def fake(x):
            if isinstance(x, torch.Tensor):
                return mode.from_tensor(x)
            if isinstance(x, ShapeDtype) or _is_array(x):
                return torch.empty(x.shape, dtype=x.dtype)
            return x
        out = fn(*tree_util.map(fake, args), **tree_util.map(fake, kwargs))
    return tree_util.map(lambda x: ShapeDtype(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x, out)


def is_abstract(t: Any) -> bool:
    """True for a tensor without values here: fake or meta, or traced by ``torch.compile`` (checks
    of its values do not apply: they would read values the trace does not have)."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if type(t) is torch.Tensor and not (_is_functional(t) or _is_functorch_wrapped(t)):
        return t.is_meta  # a plain tensor (the common case, asked per leaf per step): is_fake's answer is no
    return isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t))


# what is_fake unwraps inside a tensor of the plain class (a fake or a FakeTensor subclass is not plain)
_is_functional = torch._is_functional_tensor
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def any_abstract(ts: list) -> bool:
    """``any(is_abstract(t) for t in ts)``, a few C-level passes where all are plain tensors."""
    if torch.compiler.is_dynamo_compiling():
        return bool(ts)
    if set(map(type, ts)) <= _PLAIN and not any(map(_is_functional, ts)) and not any(map(_is_functorch_wrapped, ts)):
        return any(map(_is_meta, ts))
    return any(map(is_abstract, ts))


_PLAIN, _is_meta = {torch.Tensor}, operator.attrgetter("is_meta")


def _is_array(x: Any) -> bool:
    return hasattr(type(x), "__cfx_grad_leaf__")
