"""Shared by every kernel module: which implementation runs (``impl="auto" | "triton" | "reference"``),
and on which CUDA device a Triton launch runs (``on_device``)."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

IMPLS = ("auto", "triton", "reference")

__all__ = ["interpret_mode", "on_device", "resolve_impl"]


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for these inputs.

    ``auto`` is Triton when Triton is installed and every tensor is on CUDA, the reference
    otherwise. ``triton`` is honoured on CUDA tensors, and on CPU tensors under
    ``TRITON_INTERPRET=1`` (how the tests run the kernels); anything else is a ``ValueError``.
    """
    if impl == "auto" and tensors and not tensors[0].is_cuda:  # (the CPU's answer, at once)
        return "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "reference":
        return "reference"
    if impl == "auto":
        return "triton" if on_cuda and triton_available() else "reference"
    if not triton_available():
        raise ValueError("impl='triton' needs the triton package; use impl='reference' or 'auto'.")
    if not (on_cuda or interpret_mode()):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"impl='triton' needs CUDA tensors (got {devices}) or TRITON_INTERPRET=1 "
                         f"to run the kernel through the Triton interpreter on CPU.")
    return "triton"


def on_device(t: torch.Tensor):
    """Around a kernel's launches: Triton launches on the current CUDA device, so make it ``t``'s
    (nothing for a CPU tensor, which the interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
