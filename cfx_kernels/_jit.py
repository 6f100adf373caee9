"""``lazy_jit``: a Triton kernel decorated at its first launch, not at import.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, and so does Triton's own standard
library (``tl.sum``, ``tl.max``, ... are ``@triton.jit`` functions decorated when ``triton`` is
imported). A kernel module imported early (``import cfx`` imports them) would otherwise stay
GPU-only even if a test sets ``TRITON_INTERPRET=1`` later. So ``lazy_jit`` keeps the plain
function and decorates it at launch, once per interpreter setting; and when it launches through
the interpreter while ``triton`` was imported for the GPU, it swaps the standard library's jitted
functions for interpreted ones for the duration of the launch (the interpreter's own
``_patch_lang`` does the same to the builtins).

The interpreter also keeps bf16 as raw uint16 bits and mishandles them: ``fp32 -> bf16``
truncates (the GPU rounds to nearest even), ``int -> bf16`` and ``bf16`` ``tl.dot`` operate on
the bits as integers. During an interpreted launch those three are routed through fp32 with
round-to-nearest-even, so bf16 kernels are checked on CPU with the GPU's rounding; and Triton 3.6's
interpreter reads a scalar's index in a way numpy 2 refuses (``_interpreter_scalar_index``).

``device_function`` is ``triton.jit`` for a helper the kernels call (inlined by the compiler as
usual), which an interpreted kernel can call too: there it runs as an interpreted function, as the
standard library does during an interpreted launch.

GPU launches pass ``enable_fp_fusion=True`` (Triton's default) unless the caller says otherwise:
left implicit, Triton 3.9 warns on every first compile, and the tests turn warnings into errors.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["device_function", "lazy_jit"]


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns (uint16), rounding to nearest even."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> fp32 values (exact)."""
    return (np.ascontiguousarray(bits).astype(np.uint32) << 16).view(np.float32)


@contextlib.contextmanager
def _interpreter_bf16() -> Iterator[None]:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, _get_np_dtype

    cast_impl, create_dot = InterpreterBuilder.cast_impl, InterpreterBuilder.create_dot

    def cast(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if d == tl.bfloat16 and s != tl.bfloat16:
            data = _bf16_values(src.data) if s == tl.bfloat16 else src.data.astype(np.float32)
            return TensorHandle(_bf16_bits(data), tl.bfloat16)
        if s == tl.bfloat16 and d != tl.bfloat16:
            return TensorHandle(_bf16_values(src.data).astype(_get_np_dtype(dst_type)), d)
        return cast_impl(self, src, dst_type)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (TensorHandle(_bf16_values(t.data), tl.float32) if t.dtype.scalar == tl.bfloat16
                else t for t in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.cast_impl, InterpreterBuilder.create_dot = cast, dot
    try:
        yield
    finally:
        InterpreterBuilder.cast_impl, InterpreterBuilder.create_dot = cast_impl, create_dot


@contextlib.contextmanager
def _interpreter_scalar_index() -> Iterator[None]:
    """A scalar the interpreter holds (a kernel's int argument: ``range(0, V, BLOCK)``) as a 1-element
    array becomes an int through ``int(array)``, which numpy 2 refuses for a 1-d array; Triton 3.6's
    interpreter (the GPU image's) does just that, later ones squeeze first, as this does."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = patch_tensor


@contextlib.contextmanager
def _interpretable_stdlib() -> Iterator[None]:
    import triton.language as tl
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = []
    wrapped: dict[int, Any] = {}
    for module in (tl, standard):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                saved.append((module, name, value))
                setattr(module, name, wrapped[id(value)])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def _restored_language() -> Iterator[None]:
    """Leave ``triton.language`` as a GPU compile in this process needs it.

    The interpreter patches ``tl.core``'s builtins for a launch, and its device-function path
    (``InterpretedFunction.__call__``, taken by the stdlib functions wrapped above) never undoes
    that; and the compiler modules it imports lazily mid-launch (``code_generator``, gluon) would
    keep the patched builtins forever. Import those first and put the builtins back afterwards.
    """
    import triton.compiler.code_generator  # noqa: F401
    import triton.language as tl

    saved = [(o, dict(vars(o))) for o in (tl.core, tl.core.tensor, tl.math)]
    try:
        yield
    finally:
        for o, before in saved:
            for name, value in before.items():
                if vars(o).get(name) is not value:
                    setattr(o, name, value)


# launch options that only mean something to the GPU compiler; the interpreter rejects them
_GPU_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


class LazyKernel:
    """``kernel[grid](*args, num_warps=...)`` as with ``@triton.jit``; the decoration happens on
    first use, and GPU-only launch options are dropped when interpreting."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        import triton

        interpret = bool(triton.knobs.runtime.interpret)
        kernel = self._by_mode.get(interpret)
        if kernel is None:
            kernel = self._by_mode[interpret] = triton.jit(self.fn)
        launch = kernel[grid]
        if not interpret:
            # FMA contraction on (Triton's default), said explicitly: Triton 3.9 warns otherwise
            return lambda *args, **kwargs: launch(*args, **{"enable_fp_fusion": True, **kwargs})

        def run(*args: Any, **kwargs: Any) -> Any:
            kwargs = {k: v for k, v in kwargs.items() if k not in _GPU_OPTIONS}
            with _restored_language(), _interpretable_stdlib(), _interpreter_bf16(), _interpreter_scalar_index():
                return launch(*args, **kwargs)

        return run


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def device_function(fn: Callable[..., Any]) -> Any:
    """``@triton.jit`` for a helper the kernels call, callable under the interpreter too, whatever
    ``TRITON_INTERPRET`` was at import (module doc)."""
    try:
        import triton
    except ImportError:  # nothing launches the kernels then
        return fn

    class DeviceFunction(triton.JITFunction):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:  # reached only from an interpreted kernel
            from triton.runtime.interpreter import InterpretedFunction
            return InterpretedFunction(self.fn)(*args, **kwargs)

    return DeviceFunction(fn)
