"""Shared by every kernel module: which implementation runs (``impl="auto" | "triton" | "reference"``),
and on which CUDA device a Triton launch runs (``on_device``)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "triton", "reference")

__all__ = ["device_capability", "interpret_mode", "on_device", "resolve_impl"]


@functools.lru_cache(maxsize=None)
def device_capability(index: int | None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(index)``, asked once per device: a launch that asks every time
    pays microseconds a short kernel notices (auto attention ran 0.80-0.97 of the faster side on an H200)."""
    return torch.cuda.get_device_capability(index)


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON = importlib.util.find_spec("triton") is not None  # once: dynamo cannot trace find_spec (cfx.jit on CUDA)


def triton_available() -> bool:
    return _TRITON


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for these inputs.

    ``auto`` is Triton when Triton is installed and every tensor is on CUDA, the reference
    otherwise -- and inside code ``torch.compile`` traces (``cfx.jit``, compiled generation): there the
    reference's plain ops are what the compiler fuses into its own kernels, where a hand-written
    kernel's launch code (device queries, custom autograd) would break the graph. ``triton`` is honoured on CUDA tensors, and on CPU tensors under
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
        return "triton" if on_cuda and triton_available() and not torch.compiler.is_compiling() else "reference"
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
