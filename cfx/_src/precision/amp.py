"""Mixed-precision policy: which dtype params are stored in, computed in, and returned in.

The usual recipe keeps fp32 master params and computes in bf16 or fp16::

    policy = cfx.amp.Policy.from_string("params=float32,compute=bfloat16,output=float32")
    logits = policy.cast_to_output(model.apply(policy.cast_to_compute(params), tokens))

Gradients flow back through the casts, so they arrive in the params' dtype (fp32). fp16
compute needs dynamic loss scaling (``cfx.optim.dynamic_loss_scale``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "full": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64,
}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_NAMES)}.") from None


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def _cast_tree(tree: Any, dtype: torch.dtype) -> Any:
    return tree_util.map(lambda x: _cast(x, dtype), tree)


FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")  # (``cfx._src.nn.fp8.RECIPES``' names)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for params (storage), compute (the forward and backward) and outputs."""

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    fp8: str | None = None  # the float8 recipe the blocks' Linears run by (``cfx.amp.float8``), or None
    fp8_scaling: str = "dynamic"  # each cast's own amax, or "delayed": Transformer Engine's history

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, dtype_of(getattr(self, f)))
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"cfx.amp fp8: unknown recipe {self.fp8!r}; use one of {', '.join(FP8_RECIPES)}.")
        if self.fp8_scaling not in ("dynamic", "delayed"):
            raise ValueError(f"cfx.amp fp8: scaling={self.fp8_scaling!r}; use 'dynamic' or 'delayed'.")
        if self.fp8_scaling == "delayed" and self.fp8 != "tensorwise":
            raise ValueError(f"cfx.amp fp8: delayed scaling scales each tensor whole (Transformer Engine's); recipe "
                             f"{self.fp8!r} scales rows. Use fp8:delayed (tensorwise), or dynamic scaling.")

    @classmethod
    def from_string(cls, spec: str) -> "Policy":
        """``"params=float32,compute=bf16,output=float32"``, or a preset name (see ``policy``)."""
        if "=" not in spec:
            return policy(spec)
        kw = {}
        keys = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype",
                "output": "output_dtype", "out": "output_dtype"}
        for part in spec.split(","):
            k, _, v = part.partition("=")
            if k.strip() not in keys:
                raise ValueError(f"cfx.amp.Policy.from_string: unknown field {k!r} in {spec!r}; "
                                 "use params=, compute=, output=.")
            kw[keys[k.strip()]] = dtype_of(v.strip())
        return cls(**kw)

    @property
    def needs_loss_scaling(self) -> bool:
        return self.compute_dtype == torch.float16

    def cast_to_param(self, tree: Any) -> Any:
        return _cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """``tree`` in the compute dtype (under fp8 too: a float8 Linear scales its bf16 weight, as torchtitan's
        do under FSDP2's bf16 params)."""
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return _cast_tree(tree, self.output_dtype)


def policy(name: str, *, recipe: str | None = None, scaling: str | None = None) -> Policy:
    """Presets: ``fp32``, ``bf16`` and ``fp16`` (fp32 master params, half compute, fp32 outputs); ``fp8``
    (or ``fp8:RECIPE``): bf16's, naming the recipe by which ``cfx.amp.float8`` runs the Linear matmuls of
    every transformer block but the first in float8 -- ``tensorwise`` (the default), ``rowwise`` or
    ``rowwise_gw_hp`` (``cfx._src.nn.fp8``) -- with each cast's own amax, or ``fp8:delayed`` (or
    ``scaling="delayed"``): tensorwise, scaled from earlier steps' amaxes (``cfx._src.nn.fp8_delayed``)."""
    name = name.lower()
    if name == "fp8" or name.startswith("fp8:"):
        tail = name.partition(":")[2]
        if tail == "delayed":
            tail, scaling = "", scaling or "delayed"
        return Policy(compute_dtype=torch.bfloat16, fp8=recipe or tail or "tensorwise", fp8_scaling=scaling or "dynamic")
    if name in ("fp32", "float32", "full"):
        return Policy()
    if name in ("bf16", "bfloat16"):
        return Policy(compute_dtype=torch.bfloat16)
    if name in ("fp16", "float16", "half"):
        return Policy(compute_dtype=torch.float16)
    raise ValueError(f"cfx.amp.policy: unknown preset {name!r}; use 'fp32', 'bf16', 'fp16' or 'fp8[:recipe]', "
                     "or Policy.from_string('params=...,compute=...,output=...').")
