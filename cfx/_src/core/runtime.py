"""Process-level settings that a job's entry point may opt into (never applied at import)."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def keep_host_memory(*, mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1,
                      top_pad: int = 1 << 30) -> bool:
    """Ask glibc's malloc to keep freed host memory for reuse instead of returning it to the OS.

    Functional updates allocate fresh tensors every step (new optimizer moments, new params).
    By default glibc serves blocks above 32 MiB with ``mmap`` and unmaps them on free, so every
    step pays page faults and kernel zeroing for those bytes again. Raising the mmap and trim
    thresholds lets the next step reuse the same pages (PyTorch's CUDA caching allocator does
    the same on GPUs). Returns True if applied; a no-op returning False off glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold))
    ok &= libc.mallopt(_M_TOP_PAD, ctypes.c_int(top_pad))
    return bool(ok)
