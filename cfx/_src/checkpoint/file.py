"""Checkpoints of pytrees as safetensors files, keyed by dotted leaf paths.

``save`` writes to a temporary name in the same directory, fsyncs, then renames, so a crash
never leaves a half-written checkpoint under the real name. The temporary name carries the
writer's host and pid (``.tmp-<name>-<host>-<pid>-...``): a save removes the temporary files
that writers on this host which are no longer running left for the same checkpoint. ``load`` restores into the structure
of a template tree (e.g. ``{"params": model.init(key), "opt_state": tx.init(params)}``) and
checks every leaf's shape and dtype.

A tree of ShardedArrays is saved as a directory instead, each process writing its own blocks,
and loads onto any mesh (``checkpoint_sharded``). ``open_stored`` opens either kind for reading
rectangles of its leaves by path (``FileStored``, ``sharded.Stored``: one interface).

Every tensor's CRC-32 is written into the file's metadata and verified on load, so a file that
was truncated, is not safetensors, or had bytes changed is a one-line ``ValueError`` naming the
path (and the leaf), not a raw parser traceback or numbers that go wrong later. (Files written
before checksums were kept load unverified.)
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from typing import Any

import torch

from cfx._src.checkpoint import background, sharded
from cfx._src.checkpoint.io import check_leaves, cpu_unshared, crc32, write_atomic
from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P
from cfx._src.spmd.sharded import ShardedArray

_ROOT = "<root>"
_META_KEY = "cfx"
_CRC_KEY = "cfx_crc32"


def _flat_tensors(tree: Any) -> dict[str, torch.Tensor]:
    out = {}
    for path, x in tree_util.flatten_with_path(tree)[0]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"cfx.checkpoint.save: leaf {path or _ROOT!r} is a {type(x).__name__}, not a "
                             "tensor; keep numeric state as tensors (or pass it as metadata).")
        out[path or _ROOT] = x
    return out


def save(path: str | os.PathLike, tree: Any, *, metadata: dict[str, Any] | None = None,
         async_: bool = False) -> background.PendingSave | None:
    """Write ``tree`` (and JSON-serialisable ``metadata``) to ``path`` atomically: one file, or,
    when ``tree`` holds ShardedArrays, a directory where every process writes its own blocks
    (``checkpoint_sharded``; every process calls it). With ``async_`` it returns once the tensors
    are copied to host memory and writes them on a background thread (``background``: wait for it
    with ``PendingSave.wait()`` or ``cfx.checkpoint.wait()``)."""
    if any(isinstance(x, ShardedArray) for x in tree_util.leaves(tree)):
        return sharded.save(path, tree, metadata=metadata, async_=async_)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    background.wait()  # a save in flight (perhaps to this path) is written first
    tensors = _flat_tensors(tree)
    if not async_:
        return _write(path, cpu_unshared(tensors), metadata)
    copies, ready = background.host_copies(tensors)
    return background.start(lambda: (ready(), _write(path, copies, metadata)), f"to {path!r}")


def _write(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any] | None) -> None:
    from safetensors.torch import save_file

    directory = os.path.dirname(os.path.abspath(path))
    meta = {_META_KEY: json.dumps(metadata or {}),
            _CRC_KEY: json.dumps({k: crc32(t) for k, t in tensors.items()})}
    prefix = f".tmp-{os.path.basename(path)}-{socket.gethostname()}-"
    _sweep(directory, prefix)
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta), prefix=prefix)


def check_writable(path: str | os.PathLike, *, what: str = "cfx.checkpoint.save") -> None:
    """ValueError now if ``save(path, ...)`` could not write there (checked before a long run).

    Creates the directory if needed, and writes and removes a probe file in it."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r}: that is a directory; name a file in it "
                         f"(e.g. {os.path.join(path, 'ckpt.safetensors')!r}).")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".tmp-{os.path.basename(path)}-{socket.gethostname()}-"
                                            f"{os.getpid()}-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{what} {path!r}: cannot write a file there ({e.strerror or e}); choose a "
                         "directory this user can write, or fix its permissions.") from None


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


def load(path: str | os.PathLike, like: Any, *, mesh=None, specs: Any = P()) -> tuple[Any, dict[str, Any]]:
    """``(tree, metadata)`` restored from ``path`` into the structure of ``like``.

    Raises ValueError naming the leaf when a path is missing or unexpected, or a shape or dtype
    differs from the template's. Tensors land on the template leaves' devices. A sharded
    checkpoint (a directory) loads onto any ``mesh`` with any ``specs`` (ShardedArray leaves of
    ``like`` bring theirs), each process reading only its blocks' slices, or as whole tensors.
    This process's save in flight, if any, is written first.
    """
    background.wait()
    if os.path.isdir(path):
        return sharded.load(path, like, mesh=mesh, specs=specs)
    if mesh is not None:
        raise ValueError(f"cfx.checkpoint.load: {os.fspath(path)!r} is a single-file checkpoint of whole tensors; "
                         "load it without mesh= and device_put the leaves (or save a sharded checkpoint).")
    items, treedef = tree_util.flatten_with_path(like)
    wanted = [p or _ROOT for p, _ in items]
    with FileStored(path) as stored:
        stored.check_leaves(wanted)
        leaves = []
        for (_, ref), key in zip(items, wanted):
            t = stored.read(key)
            if hasattr(ref, "shape") and hasattr(ref, "dtype"):  # a tensor or a ShapeDtype (eval_shape)
                if t.shape != tuple(ref.shape) or t.dtype != ref.dtype:
                    raise ValueError(f"cfx.checkpoint.load: leaf {key!r} is {t.dtype} {tuple(t.shape)} in the "
                                     f"checkpoint but {ref.dtype} {tuple(ref.shape)} in the template.")
                if isinstance(ref, torch.Tensor):
                    t = t.to(ref.device)
            leaves.append(t)
        return tree_util.unflatten(treedef, leaves), stored.metadata


def open_stored(path: str | os.PathLike) -> "FileStored | sharded.Stored":
    """The checkpoint at ``path`` opened for reading rectangles of its leaves: a directory's
    ``sharded.Stored`` or a file's ``FileStored`` (the same interface; a context manager), after
    this process's save in flight, if any, is written."""
    background.wait()
    return sharded.Stored(path) if os.path.isdir(path) else FileStored(path)


class FileStored:
    """One checkpoint file opened for reading, with ``sharded.Stored``'s interface: ``path``,
    ``leaves`` (its leaf paths), ``shape`` / ``dtype``, ``metadata``, ``check_leaves`` and
    ``region``, so that code reading rectangles of leaves (a Plan's load in model coordinates)
    reads a file or a directory alike. A leaf is read whole once, checked against its CRC-32, and
    kept until the file is closed. A context manager. A missing, truncated or foreign file is a
    one-line ValueError naming the path."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ValueError(f"cfx.checkpoint.load: no checkpoint at {self.path!r}.")
        self._file = self._parsed(lambda: safe_open(self.path, framework="pt"))
        header = self._parsed(lambda: (self._file.metadata() or {},
                                       {k: self._file.get_slice(k) for k in self._file.keys()}))
        self.metadata = _json(header[0], _META_KEY, self.path)
        self._crcs = _json(header[0], _CRC_KEY, self.path)
        self.leaves = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in header[1].items()}
        self._whole: dict[str, torch.Tensor] = {}

    def _parsed(self, fn):
        try:
            return fn()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the parser's errors (SafetensorError, OSError, ...)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"cfx.checkpoint.load: {self.path!r} is not a readable checkpoint ({reason}); it may be "
                             "truncated (a copy or a save cut short) or another format. Restore it from another copy "
                             "or point at a file cfx.checkpoint.save wrote.") from None

    def shape(self, path: str) -> tuple[int, ...]:
        return self.leaves[path][0]

    def dtype(self, path: str) -> torch.dtype:
        name = self.leaves[path][1]
        return _DTYPES[name] if name in _DTYPES else self.read(path).dtype

    def check_leaves(self, wanted: list[str]) -> None:
        """A ValueError unless the file holds exactly the leaves ``wanted``."""
        check_leaves(self.path, self.leaves, wanted)

    def read(self, path: str) -> torch.Tensor:
        """Leaf ``path`` whole, checked against the CRC-32 written with it."""
        if path not in self._whole:
            t = self._parsed(lambda: self._file.get_tensor(path))
            if path in self._crcs and crc32(t.contiguous()) != self._crcs[path]:
                raise ValueError(f"cfx.checkpoint.load: leaf {path!r} in {self.path!r} is corrupted (its bytes do "
                                 "not match the checksum written with them); restore the file from another copy.")
            self._whole[path] = t
        return self._whole[path]

    def region(self, path: str, lo: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """The rectangle ``[lo, lo + size)`` of leaf ``path`` (a view of the leaf read whole)."""
        return self.read(path)[tuple(slice(a, a + n) for a, n in zip(lo, size))]

    def __enter__(self) -> "FileStored":
        return self

    def __exit__(self, *exc) -> None:
        self._whole.clear()
        self._file.__exit__(None, None, None)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _json(meta: dict, key: str, path: str) -> Any:
    try:
        return json.loads(meta.get(key, "{}"))
    except json.JSONDecodeError as e:
        raise ValueError(f"cfx.checkpoint.load: {path!r} has corrupted metadata ({key}: {e}); restore the "
                         "file from another copy.") from None
