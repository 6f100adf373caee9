"""What both checkpoint formats share: atomic file writes and CRC-32s of tensors."""
from __future__ import annotations

import os
import tempfile
import zlib
from typing import Callable, Iterable

import torch


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (any dtype)."""
    if t.numel() == 0:
        return 0
    return zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def cpu_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` detached, on the CPU and contiguous, each owning its storage: safetensors refuses
    tensors that share one (tied weights, views of one buffer) or view part of a larger one."""
    out, seen = {}, set()
    for key, x in tensors.items():
        t = x.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def write_atomic(path: str, write: Callable[[str], None], *, prefix: str | None = None) -> None:
    """``write(tmp)`` to a temporary file beside ``path`` (named ``prefix<pid>-...``), fsync it,
    then rename it to ``path``: readers see the old file or the new one, never half of one."""
    directory, base = os.path.split(os.path.abspath(path))
    prefix = prefix or f".tmp-{base}-"
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_leaves(where: str, held: Iterable[str], wanted: list[str]) -> None:
    """A ValueError unless the checkpoint at ``where`` holds exactly the leaves ``wanted``."""
    held = set(held)
    missing, extra = [p for p in wanted if p not in held], sorted(held - set(wanted))
    if missing or extra:
        raise ValueError(f"cfx.checkpoint.load: {where!r} does not match the template: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}. Build the template with the model config and optimizer that wrote "
                         "the checkpoint.")
