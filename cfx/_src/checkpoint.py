"""Checkpoints of pytrees as safetensors files, keyed by dotted leaf paths.

``save`` writes to a temporary name in the same directory, fsyncs, then renames, so a crash
never leaves a half-written checkpoint under the real name. The temporary name carries the
writer's host and pid (``.tmp-<name>-<host>-<pid>-...``): a save removes the temporary files
that writers on this host which are no longer running left for the same checkpoint. ``load`` restores into the structure
of a template tree (e.g. ``{"params": model.init(key), "opt_state": tx.init(params)}``) and
checks every leaf's shape and dtype.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from typing import Any

import torch

from cfx._src import tree as tree_util

_ROOT = "<root>"
_META_KEY = "cfx"


def _flat_tensors(tree: Any) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for path, x in tree_util.flatten_with_path(tree)[0]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"cfx.checkpoint.save: leaf {path or _ROOT!r} is a {type(x).__name__}, not a "
                             "tensor; keep numeric state as tensors (or pass it as metadata).")
        t = x.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses shared or partial storages
        seen.add(t.untyped_storage().data_ptr())
        out[path or _ROOT] = t
    return out


def save(path: str | os.PathLike, tree: Any, *, metadata: dict[str, Any] | None = None) -> None:
    """Write ``tree`` (and JSON-serialisable ``metadata``) to ``path`` atomically."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tensors = _flat_tensors(tree)
    meta = {_META_KEY: json.dumps(metadata or {})}
    prefix = f".tmp-{os.path.basename(path)}-{socket.gethostname()}-"
    _sweep(directory, prefix)
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _sweep(directory: str, prefix: str) -> None:
    """Remove ``prefix<pid>-*`` files in ``directory`` whose pid no longer runs (a killed save's)."""
    for name in os.listdir(directory):
        pid = name[len(prefix):].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def load(path: str | os.PathLike, like: Any) -> tuple[Any, dict[str, Any]]:
    """``(tree, metadata)`` restored from ``path`` into the structure of ``like``.

    Raises ValueError naming the leaf when a path is missing or unexpected, or a shape or dtype
    differs from the template's. Tensors land on the template leaves' devices.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"cfx.checkpoint.load: no checkpoint at {path!r}.")
    items, treedef = tree_util.flatten_with_path(like)
    with safe_open(path, framework="pt") as f:
        stored = set(f.keys())
        wanted = [p or _ROOT for p, _ in items]
        missing = [p for p in wanted if p not in stored]
        extra = sorted(stored - set(wanted))
        if missing or extra:
            raise ValueError(f"cfx.checkpoint.load: {path!r} does not match the template: missing "
                             f"{missing[:5]}, unexpected {extra[:5]}. Build the template with the same "
                             "model config and optimizer that wrote the checkpoint.")
        leaves = []
        for (p, ref), key in zip(items, wanted):
            t = f.get_tensor(key)
            if hasattr(ref, "shape") and hasattr(ref, "dtype"):  # a tensor or a ShapeDtype (eval_shape)
                if t.shape != tuple(ref.shape) or t.dtype != ref.dtype:
                    raise ValueError(f"cfx.checkpoint.load: leaf {key!r} is {t.dtype} {tuple(t.shape)} in the "
                                     f"checkpoint but {ref.dtype} {tuple(ref.shape)} in the template.")
                if isinstance(ref, torch.Tensor):
                    t = t.to(ref.device)
            leaves.append(t)
        meta = json.loads((f.metadata() or {}).get(_META_KEY, "{}"))
    return tree_util.unflatten(treedef, leaves), meta
