"""Sharded checkpoints: every process writes its own blocks; a load reads only the slices it needs.

A checkpoint is a directory::

    ckpt/
      index.json                 the commit marker: leaves, their blocks, files, metadata
      g000003-p00000.safetensors one file per writing process and save ("generation" 3)
      g000003-p00001.safetensors

``save(directory, tree)`` takes a pytree of ShardedArrays (any mesh, any specs) and tensors.
Each process writes the blocks it addresses, only the *primary* copy of each (coordinate 0 on
the axes a spec leaves out, so replicas are written once), with every block's global offsets
and CRC-32. When every process has written and fsynced its file (a barrier under ``dist``),
process 0 writes ``index.json`` under a temporary name and renames it into place: the rename is
the commit. A save killed before it leaves the previous index -- and the files it names --
untouched, so the previous checkpoint still loads; the next save removes the dead files.

``save(..., async_=True)`` returns once this process's blocks are copied to host memory
(``background``); a thread writes the file and listing, and process 0's thread commits once every
process's listing is there (the processes meet through the files: a collective from the thread
would race the training step's). One save is in flight per process; the next waits for it.

``load(directory, like, mesh=, specs=)`` returns ``like``'s structure with each leaf laid out
by its own ``spec`` on ``mesh`` (ShardedArray leaves of ``like`` bring their own): for each
block a process addresses, only the overlapping slices of the stored blocks are read (safetensors
reads a slice without the rest of the tensor), so a process holds its blocks plus one slice at a
time. The save's mesh and specs do not matter: a run saved on ``{"data": 4}`` loads on
``{"data": 2, "model": 2}``, on a pipe mesh or, with ``mesh=None``, as whole tensors on one
device. A stored block read whole is checked against its CRC-32; a file shorter or longer than
the index records, a missing file or index, a leaf that is not there or differs in shape or
dtype: a ``ValueError`` naming the path, the file and the fix.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
from typing import Any

import torch

from cfx._src.mesh import memory
from cfx._src.checkpoint import background
from cfx._src.checkpoint.io import check_leaves, cpu_unshared, crc32, fsync_dir, write_atomic
from cfx._src.core import tree as tree_util
from cfx._src.mesh.layout import is_primary
from cfx._src.mesh.spec import P, is_spec
from cfx._src.spmd.sharded import ShardedArray

FORMAT = "cfx-sharded/1"
INDEX = "index.json"
_ROOT = "<root>"


# -- save ------------------------------------------------------------------------------------------
def save(directory: str | os.PathLike, tree: Any, *, metadata: dict[str, Any] | None = None,
         async_: bool = False) -> background.PendingSave | None:
    """Write ``tree`` into ``directory`` (module doc): every process calls it (a collective under
    ``dist``); returns once the checkpoint is committed -- or, with ``async_``, once this process's
    blocks are copied to host memory, the write going on in the background (``PendingSave``)."""
    blocks, leaves = _blocks_to_write(tree, _process()[0])
    return _write(directory, blocks, leaves, metadata, async_)


def save_boxes(directory: str | os.PathLike, leaves: dict[str, tuple[tuple[int, ...], torch.dtype]],
               boxes: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]], *,
               metadata: dict[str, Any] | None = None, async_: bool = False) -> background.PendingSave | None:
    """``save`` for state that is not one ShardedArray per leaf (a Plan's, in model coordinates):
    ``leaves`` gives every leaf's global shape and dtype (the same on every process), ``boxes``
    the rectangles ``(global offsets, tensor)`` of each leaf that this process writes; together
    the processes' boxes must tile each leaf once (``load`` says which elements are missing)."""
    listing = {path: {"shape": list(shape), "dtype": _dtype_name(dtype)} for path, (shape, dtype) in leaves.items()}
    blocks = {f"{path}#{i}": (path, t, tuple(offsets))
              for path, own in boxes.items() for i, (offsets, t) in enumerate(own)}
    return _write(directory, blocks, listing, metadata, async_)


def _write(directory: str | os.PathLike, blocks: dict, leaves: dict, metadata: dict | None,
           async_: bool) -> background.PendingSave | None:
    """Every process's file and listing, then process 0's commit (module doc). An asynchronous save
    copies the blocks to host memory and does the rest on a thread, whose processes meet through
    the files (each waits for the listings, not on a collective, which would race the step's)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    background.wait()  # the save in flight first: the generations follow one another
    process, processes = _process()
    generation = _next_generation(directory)
    tensors = {key: t for key, (_, t, _) in blocks.items()}
    offsets = {key: (path, offsets) for key, (path, _, offsets) in blocks.items()}
    meta = metadata or {}
    if not async_:
        _write_files(directory, generation, process, tensors, offsets)
        _barrier()
        if process == 0:
            _commit(directory, generation, processes, leaves, meta)
        _barrier()
        return None
    copies, ready = background.host_copies(tensors)

    def write() -> None:
        ready()
        _write_files(directory, generation, process, copies, offsets)
        if process == 0:
            _await_listings(directory, generation, processes)
            _commit(directory, generation, processes, leaves, meta)
    return background.start(write, f"of generation {generation} to {directory!r}")


_started: dict[str, int] = {}  # directory -> the last generation this process started writing there


def _next_generation(directory: str) -> int:
    """One more than the committed index's or the last this process started (an asynchronous save's
    commit may still be on its way): every process computes the same number."""
    generation = max(_current(directory).get("generation", 0), _started.get(os.path.abspath(directory), 0)) + 1
    _started[os.path.abspath(directory)] = generation
    return generation


def _write_files(directory: str, generation: int, process: int, tensors: dict, offsets: dict) -> None:
    """This process's blocks as one safetensors file, then its listing (the sign it is done)."""
    from safetensors.torch import save_file

    stem = f"g{generation:06d}-p{process:05d}"
    tensors = cpu_unshared(tensors)
    write_atomic(os.path.join(directory, stem + ".safetensors"), lambda tmp: save_file(tensors, tmp))
    listing = {key: {"leaf": path, "offsets": list(lo), "shape": list(tensors[key].shape), "crc32": crc32(tensors[key])}
               for key, (path, lo) in offsets.items()}
    size = os.path.getsize(os.path.join(directory, stem + ".safetensors"))
    write_atomic(os.path.join(directory, stem + ".json"), lambda tmp: _dump(tmp, {"blocks": listing, "bytes": size}))


def _await_listings(directory: str, generation: int, processes: int, timeout: float = 1800.0) -> None:
    """Process 0's writer: wait until every process's listing of ``generation`` is in place."""
    names = [os.path.join(directory, f"g{generation:06d}-p{p:05d}.json") for p in range(processes)]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(n) for n in names):
        if time.monotonic() > deadline:
            missing = [os.path.basename(n) for n in names if not os.path.exists(n)]
            raise TimeoutError(f"processes did not finish their part of {directory!r} in {timeout:.0f} s "
                               f"(missing {missing[:4]}); the previous checkpoint is still the committed one.")
        time.sleep(0.02)


def _blocks_to_write(tree: Any, process: int) -> tuple[dict, dict]:
    """``({key: (leaf path, block, global offsets)}, {leaf path: {"shape", "dtype"}})`` of the
    primary blocks this process addresses."""
    blocks, leaves = {}, {}
    for path, x in tree_util.flatten_with_path(tree)[0]:
        path = path or _ROOT
        if isinstance(x, ShardedArray):
            if x.partial:
                raise ValueError(f"cfx.checkpoint.save: leaf {path!r} holds unreduced partial sums over "
                                 f"{x.partial}; psum it (or reshard) before saving.")
            leaves[path] = {"shape": list(x.shape), "dtype": _dtype_name(x.dtype)}
            for rank, block in x.blocks.items():
                coords = x.mesh.coords(rank)
                if is_primary(x.spec, x.mesh, coords):
                    offsets = _offsets(block.shape, x.spec, x.mesh, coords)
                    blocks[f"{path}@{rank}"] = (path, block, offsets)
        elif isinstance(x, torch.Tensor):
            leaves[path] = {"shape": list(x.shape), "dtype": _dtype_name(x.dtype)}
            if process == 0:
                blocks[f"{path}@whole"] = (path, x, (0,) * x.dim())
        else:
            raise ValueError(f"cfx.checkpoint.save: leaf {path!r} is a {type(x).__name__}, not a tensor or a "
                             "ShardedArray; keep numeric state as tensors (or pass it as metadata).")
    return blocks, leaves


def _commit(directory: str, generation: int, processes: int, leaves: dict, metadata: dict) -> None:
    """Process 0, after every process wrote: the index from the processes' listings, renamed into
    place; then the files of earlier (or killed) saves removed."""
    files, listed = {}, []
    for p in range(processes):
        stem = f"g{generation:06d}-p{p:05d}"
        listed.append(os.path.getmtime(os.path.join(directory, stem + ".json")))
        with open(os.path.join(directory, stem + ".json")) as f:
            listing = json.load(f)
        files[stem + ".safetensors"] = listing["bytes"]
        for key, b in listing["blocks"].items():
            leaves[b["leaf"]].setdefault("blocks", []).append(
                {"file": stem + ".safetensors", "key": key, "offsets": b["offsets"], "shape": b["shape"],
                 "crc32": b["crc32"]})
    index = {"format": FORMAT, "generation": generation, "files": files, "leaves": leaves, "metadata": metadata}
    write_atomic(os.path.join(directory, INDEX), lambda tmp: _dump(tmp, index))
    fsync_dir(directory)
    for name in os.listdir(directory):  # earlier generations, killed saves' leftovers, listings --
        made = _generation_of(name)     # not a later one's, which another process may be writing
        path = os.path.join(directory, name)
        ours = made is not None and made <= generation and name != INDEX and (name.endswith(".json") or name not in files)
        with contextlib.suppress(FileNotFoundError):
            if ours or (_SAFETENSORS_TMP.fullmatch(name) and os.path.getmtime(path) < min(listed)):
                os.remove(path)


# safetensors writes a file through a temporary ``.tmpXXXXXX`` beside it (Rust's tempfile): one a killed
# save left is older than every listing of the generation being committed, while one a process is
# writing now for a later generation is newer than its own listing of this one
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def _generation_of(name: str) -> int | None:
    """The generation a file of the directory belongs to (``g000003-p00001.json``, or its temporary
    ``.tmp-g000003-...``), or None for files that are not a save's."""
    if name.startswith(f".tmp-{INDEX}"):  # a commit cut short (only process 0 commits, one at a time)
        return 0
    match = re.match(r"(?:\.tmp-)?g(\d{6})-", name)
    return int(match.group(1)) if match else None


# -- load ------------------------------------------------------------------------------------------
def load(directory: str | os.PathLike, like: Any, *, mesh=None, specs: Any = P()) -> tuple[Any, dict[str, Any]]:
    """``(tree, metadata)``: ``like``'s structure with each leaf read from the checkpoint in
    ``directory`` and laid out on ``mesh`` by ``specs`` (a P or a pytree prefix of them;
    ShardedArray leaves of ``like`` use their own mesh and spec), or whole tensors without a
    mesh. Every process calls it and reads only its own blocks' slices (module doc)."""
    items, treedef = tree_util.flatten_with_path(like)
    spec_of = _specs_for(like, len(items), specs, mesh)
    wanted = [p or _ROOT for p, _ in items]
    with Stored(directory) as stored:
        stored.check_leaves(wanted)
        out = [_load_leaf(stored, path, ref, mesh, spec)
               for (path, ref, spec) in zip(wanted, [x for _, x in items], spec_of)]
    return tree_util.unflatten(treedef, out), stored.metadata


class Stored:
    """A committed checkpoint opened for reading: its ``path``, ``leaves`` (by path), ``shape`` /
    ``dtype`` of each, ``metadata``, and ``region``, which reads any rectangle of a leaf from the
    overlapping slices of the stored blocks. A context manager (closing its files). One file of
    whole tensors opens with the same interface (``checkpoint.file.FileStored``)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = self.directory = os.fspath(directory)
        index = _current(self.directory)
        if not index:
            raise ValueError(f"cfx.checkpoint.load: no committed checkpoint in {self.directory!r} (no {INDEX}: "
                             "nothing was saved there, or every save was cut short before its commit).")
        self.leaves, self.metadata = index["leaves"], index.get("metadata", {})
        self._reader = _Reader(self.directory, index["files"])

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(self.leaves[path]["shape"])

    def dtype(self, path: str) -> torch.dtype:
        return _dtype(self.leaves[path]["dtype"])

    def check_leaves(self, wanted: list[str]) -> None:
        """A ValueError unless the checkpoint holds exactly the leaves ``wanted``."""
        check_leaves(self.directory, self.leaves, wanted)

    def region(self, path: str, lo: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """The rectangle ``[lo, lo + size)`` of leaf ``path``."""
        return _region(self._reader, path, self.leaves[path], tuple(lo), tuple(size), self.dtype(path))

    def __enter__(self) -> "Stored":
        return self

    def __exit__(self, *exc) -> None:
        self._reader.close()


def _load_leaf(stored: Stored, path: str, ref: Any, mesh, spec: P) -> Any:
    shape, dtype = stored.shape(path), stored.dtype(path)
    if hasattr(ref, "shape") and hasattr(ref, "dtype") and (tuple(ref.shape) != shape or ref.dtype != dtype):
        raise ValueError(f"cfx.checkpoint.load: leaf {path!r} is {dtype} {shape} in the checkpoint but "
                         f"{ref.dtype} {tuple(ref.shape)} in the template.")
    if isinstance(ref, ShardedArray):
        mesh, spec = ref.mesh, ref.spec
    if mesh is None:
        return stored.region(path, (0,) * len(shape), shape)
    from cfx._src.mesh.layout import block_shape, check_spec
    check_spec(path, shape, spec, mesh, "cfx.checkpoint.load")
    size = block_shape(shape, spec, mesh)
    blocks = {}
    for rank in mesh.local_ranks:
        lo = _offsets(size, spec, mesh, mesh.coords(rank))
        blocks[rank] = stored.region(path, lo, size)
    return ShardedArray(shape, spec, mesh, blocks)


def _region(reader, path: str, entry: dict, lo: tuple, size: tuple, dtype) -> torch.Tensor:
    """The global region ``[lo, lo + size)`` of leaf ``path``, assembled from the stored blocks'
    overlapping slices (each read alone)."""
    out = torch.empty(size, dtype=dtype)
    memory.watch(out, tier="host", kind="checkpoint")  # booked while a cfx.memory tracker is active
    covered = 0
    for b in entry.get("blocks", []):
        s_lo, s_size = b["offsets"], b["shape"]
        a = [max(l, sl) for l, sl in zip(lo, s_lo)]
        z = [min(l + n, sl + sn) for l, n, sl, sn in zip(lo, size, s_lo, s_size)]
        if any(x >= y for x, y in zip(a, z)) and len(size):
            continue
        piece = reader.read(path, b, tuple(slice(x - sl, y - sl) for x, y, sl in zip(a, z, s_lo)))
        memory.watch(piece, tier="host", kind="checkpoint")
        out[tuple(slice(x - l, y - l) for x, y, l in zip(a, z, lo))] = piece
        covered += piece.numel()
    if covered != out.numel():
        raise ValueError(f"cfx.checkpoint.load: leaf {path!r}: the checkpoint's blocks cover {covered} of the "
                         f"{out.numel()} elements asked for; its index is inconsistent. Restore it from another copy.")
    return out


class _Reader:
    """Open safetensors files of one checkpoint, checked against the index's sizes on first use."""

    def __init__(self, directory: str, files: dict[str, int]):
        self.directory, self.files, self.open = directory, files, {}

    def read(self, leaf: str, block: dict, where: tuple) -> torch.Tensor:
        name = block["file"]
        f = self._file(name, leaf)
        try:
            whole = all(s.start == 0 and s.stop == n for s, n in zip(where, block["shape"]))
            t = f.get_tensor(block["key"]) if whole else f.get_slice(block["key"])[where]
        except Exception as e:  # noqa: BLE001 - the parser's errors
            raise ValueError(f"cfx.checkpoint.load: leaf {leaf!r} in {name!r} of {self.directory!r} cannot be read "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); restore the file from "
                             "another copy.") from None
        if whole and crc32(t) != block["crc32"]:
            raise ValueError(f"cfx.checkpoint.load: leaf {leaf!r} in {name!r} of {self.directory!r} is corrupted "
                             "(its bytes do not match the checksum written with them); restore the file from "
                             "another copy.")
        return t

    def _file(self, name: str, leaf: str):
        from safetensors import safe_open
        if name not in self.open:
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise ValueError(f"cfx.checkpoint.load: {path!r}, which holds leaf {leaf!r}, is missing; copy the "
                                 "whole checkpoint directory, not only its index.")
            if os.path.getsize(path) != self.files[name]:
                raise ValueError(f"cfx.checkpoint.load: {path!r} has {os.path.getsize(path)} bytes but was written "
                                 f"with {self.files[name]}: it is truncated or was changed. Restore it from another copy.")
            try:
                self.open[name] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"cfx.checkpoint.load: {path!r} is not a readable shard ({e}); restore it from "
                                 "another copy.") from None
        return self.open[name]

    def close(self) -> None:
        self.open.clear()


# -- helpers ---------------------------------------------------------------------------------------
def _offsets(size, spec: P, mesh, coords: dict) -> tuple[int, ...]:
    """Global offsets of the block of ``size`` the rank at ``coords`` holds under ``spec``."""
    return tuple(mesh.index_in(spec.axes_of(d), coords) * n if spec.axes_of(d) else 0 for d, n in enumerate(size))


def _specs_for(like: Any, n: int, specs: Any, mesh) -> list[P]:
    """Each leaf's spec: ``specs`` broadcast over ``like`` as ``shard_map`` does (a prefix)."""
    if mesh is None or is_spec(specs):
        return [specs if is_spec(specs) else P()] * n
    from cfx._src.spmd.spec_tree import broadcast_specs
    return [s for _, _, s in broadcast_specs(specs, like, "like", mesh, where="cfx.checkpoint.load")]


def _process() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _current(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cfx.checkpoint: {path!r} is not a readable index ({e}); restore it from another copy.") from None
    if index.get("format") != FORMAT:
        raise ValueError(f"cfx.checkpoint: {path!r} is format {index.get('format')!r}, not {FORMAT!r}.")
    return index


def _dump(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cfx.checkpoint.load: unknown dtype {name!r} in the index.")
    return dtype
