"""``torch.distributed.checkpoint`` (DCP) directories of a torch model and ``torch.optim.AdamW``,
read into and written from a Plan's state in model coordinates: ``cfx.checkpoint.from_dcp`` /
``to_dcp``.

Torch's documented flow saves ``{"model": model_sd, "optimizer": optim_sd}`` from
``get_state_dict(model, optimizer)`` (an FSDP2 ``fully_shard`` model's DTensors, each process its
shards). In model coordinates that is cfx's state under other names: the model's params are the
torch module's state dict (``names``: ``"hf"`` is ``cfx.models.to_hf``'s, e.g. ``GPT2LMHeadModel``'s,
or any ``params -> state dict`` function; ``dcp_names`` reads the layout off it), AdamW's ``mu`` /
``nu`` are each param's ``exp_avg`` / ``exp_avg_sq`` under the same names, and its ``count`` is
torch's per-param ``step`` (all equal). ``cfx.optim.adamw`` and ``torch.optim.AdamW`` are the same
update given the same learning rate, betas, eps and weight decay (on every param, unless a mask
says otherwise), so either side continues the other's run.

``from_dcp(directory, model, tx)`` opens a DCP directory as a checkpoint of ``model``'s params and
``tx``'s state (``checkpoint.file.open_stored``'s interface), which ``Program.load`` reads into any
plan's state, each region its ranks hold read as the rectangles of torch tensors it is made of
(DCP reads each stored shard that overlaps whole, then cuts it). ``to_dcp(directory, program,
state)`` writes the state as the directory ``dcp.load`` + ``set_state_dict`` read into a torch
model and AdamW: the model's and moments' whole tensors (process 0 gathers them, as a ``.safetensors``
save does) written by process 0, with one param group from ``adamw=`` (the keyword arguments of the
``torch.optim.AdamW`` that will load it; ``set_state_dict`` restores them from the checkpoint).
A learning-rate schedule is not carried: torch keeps it in its ``LRScheduler``, not the optimizer.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.plan.dcp_names import TorchNames
from cfx._src.plan.program import Program
from cfx._src.plan.saving import model_leaves
from cfx._src.transforms.shapes import eval_shape

MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}


def optimizer_roles(shapes: Any, tx: Any) -> dict[str, tuple[str, str | None]]:
    """``{opt_state path: (torch's state name, params path)}``: ``mu`` / ``nu`` leaves mirror a param
    (``exp_avg`` / ``exp_avg_sq``), a scalar ``count`` is ``("step", None)``; ValueError for any other
    leaf (the state of an optimizer torch's AdamW does not keep)."""
    params = {p for p, _ in tree_util.flatten_with_path(shapes)[0]}
    roles = {}
    for path, x in tree_util.flatten_with_path(eval_shape(tx.init, shapes))[0]:
        parts = path.split(".")
        mirrored = [(MOMENTS[parts[i]], ".".join(parts[i + 1:])) for i in range(len(parts))
                    if parts[i] in MOMENTS and ".".join(parts[i + 1:]) in params]
        if mirrored:
            roles[f"opt_state.{path}"] = mirrored[-1]
        elif parts[-1] == "count" and not x.shape:
            roles[f"opt_state.{path}"] = ("step", None)
        else:
            raise ValueError(f"cfx.checkpoint: the optimizer's state has {path!r}, which torch.optim.AdamW's state "
                             "has no counterpart of; DCP interop carries cfx.optim.adamw's (or adam's) state.")
    return roles


def from_dcp(directory: str | os.PathLike, model: Any, tx: Any, *, names: str | Callable = "hf",
             model_key: str = "model", optim_key: str = "optimizer") -> "DcpCheckpoint":
    """The DCP directory ``directory`` opened as a checkpoint of ``model``'s params and ``tx``'s
    state: ``program.load(from_dcp(...), state)`` reads it into any plan (module doc). ``names``:
    the torch model's names (``"hf"`` or a ``params -> state dict`` function); ``model_key`` /
    ``optim_key``: the top-level keys the model's and optimizer's state dicts were saved under."""
    return DcpCheckpoint(directory, model, tx, names=names, model_key=model_key, optim_key=optim_key)


class DcpCheckpoint:
    """A DCP directory read as cfx's state in model coordinates (``path``, ``metadata`` --
    ``{"step": ...}``, ``leaves``, ``shape`` / ``dtype``, ``region``; a context manager)."""

    def __init__(self, directory, model, tx, *, names, model_key: str, optim_key: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = os.fspath(directory)
        if not os.path.isfile(os.path.join(self.path, ".metadata")):
            raise ValueError(f"cfx.checkpoint.from_dcp: no torch.distributed.checkpoint at {self.path!r} (no .metadata "
                             "file); point at the directory dcp.save wrote.")
        self._reader = FileSystemReader(self.path)
        self._metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self._metadata, True)
        self._stored = self._metadata.state_dict_metadata
        shapes = eval_shape(model.init, jr.key(0))
        self._want = model_leaves(shapes, tx)
        self.leaves = list(self._want)
        self._names = TorchNames(model, names)
        self._roles = optimizer_roles(shapes, tx)
        self._keys = {"params": lambda k: f"{model_key}.{k}",
                      **{s: (lambda k, s=s: f"{optim_key}.state.{k}.{s}") for s in MOMENTS.values()}}
        self._check_unexpected(optim_key)
        in_torch_order = sorted(self._names.paths, key=lambda p: self._names.keys.index(self._names.pieces[p][0].key))
        self._pieces = {(kind, p): self._chosen(kind, p) for kind in self._keys for p in in_torch_order}
        self.metadata = {"step": self._step(optim_key)}

    def shape(self, path: str) -> tuple[int, ...]:
        return self._want[path][0]

    def dtype(self, path: str) -> torch.dtype:
        return self._want[path][1]

    def region(self, path: str, lo: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """The rectangle ``[lo, lo + size)`` of model-coordinate leaf ``path``, read from the torch
        tensors it is made of."""
        dtype = self._want[path][1]
        if path.startswith("params."):
            kind, param = "params", path[len("params."):]
        else:
            kind, param = self._roles[path]
        if kind == "step":
            return torch.full(size, self.metadata["step"], dtype=dtype)
        hi = tuple(a + n for a, n in zip(lo, size))
        boxes = {piece: box for piece in self._pieces[(kind, param)] if (box := piece.box(lo, hi)) is not None}
        read = _read(self._reader, self._metadata, {self._keys[kind](q.key): box for q, box in boxes.items()})
        out = torch.empty(size, dtype=dtype)
        for piece in boxes:  # each piece's part of the rectangle: [a, b) in the leaf
            a = tuple(max(x, y) for x, y in zip(lo, piece.lo))
            b = tuple(min(x, y + n) for x, y, n in zip(hi, piece.lo, piece.size))
            t = piece.to_cfx(read[self._keys[kind](piece.key)], tuple(y - x for x, y in zip(a, b)))
            out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = t
        return out

    def _chosen(self, kind: str, path: str) -> list:
        """The pieces of cfx leaf ``path`` read for ``kind`` (params or a moment): of the torch keys
        holding each rectangle (a tied one is held twice), the first this checkpoint has."""
        out, covered, missing = [], set(), []
        for piece in self._names.pieces[path]:
            key = self._keys[kind](piece.key)
            if (piece.lo, piece.size) in covered:
                continue
            if key not in self._stored:
                missing.append(key)
                continue
            self._check_shape(key, piece.key, path)
            covered.add((piece.lo, piece.size))
            out.append(piece)
        if sum(_numel(q.size) for q in out) != _numel(self._names.leaf_shapes[path]):
            fix = ("save the model's and torch.optim.AdamW's state dicts (get_state_dict(model, optimizer))"
                   if kind != "params" else "pass names= for the torch model's naming")
            raise ValueError(f"cfx.checkpoint.from_dcp: {self.path!r} has no {missing[0]!r} (cfx's {path!r}); it "
                             f"holds {_prefixes(self._stored)}. Pass model_key= / optim_key= naming the keys the state "
                             f"dicts were saved under, or {fix}.")
        return out

    def _check_shape(self, key: str, name: str, path: str) -> None:
        stored = tuple(getattr(self._stored[key], "size", ()))
        if stored != self._names.shapes[name]:
            raise ValueError(f"cfx.checkpoint.from_dcp: {key!r} is {stored} in {self.path!r} but "
                             f"{self._names.shapes[name]} for this model (cfx's {path!r}); build the cfx model with "
                             "the config of the model that saved it.")

    def _check_unexpected(self, optim_key: str) -> None:
        """ValueError if the checkpoint holds AdamW state of params the model lacks (another config:
        more layers). Params are what the optimizer keeps state for: a buffer is none."""
        known, head = set(self._names.keys), f"{optim_key}.state."
        extra = sorted({k[len(head):].rsplit(".", 1)[0] for k in self._stored if k.startswith(head)} - known)
        if extra:
            raise ValueError(f"cfx.checkpoint.from_dcp: {self.path!r} holds params {extra[:3]}, which this model "
                             f"has not ({len(extra)} such); build the cfx model with the config of the model that "
                             "saved it.")

    def _step(self, optim_key: str) -> int:
        """torch's ``step``, the same for every param (cfx's one count)."""
        keys = [f"{optim_key}.state.{k}.step" for k in self._names.params]
        have = [k for k in keys if k in self._stored]
        if not have:
            raise ValueError(f"cfx.checkpoint.from_dcp: {self.path!r} has no {keys[0]!r}; it holds "
                             f"{_prefixes(self._stored)}. Save torch.optim.AdamW's state (get_state_dict(model, "
                             "optimizer)), or pass optim_key= naming the key it was saved under.")
        steps = {k: float(t) for k, t in _read(self._reader, self._metadata, {k: ((), ()) for k in have}).items()}
        if len(set(steps.values())) > 1:
            raise ValueError(f"cfx.checkpoint.from_dcp: the params in {self.path!r} were stepped unequally "
                             f"({dict(list(steps.items())[:3])}); cfx's AdamW keeps one count for all of them.")
        return int(next(iter(steps.values())))

    def __enter__(self) -> "DcpCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        pass


def to_dcp(directory: str | os.PathLike, program: Any, state: Any, *, names: str | Callable = "hf",
           adamw: dict | None = None, model_key: str = "model", optim_key: str = "optimizer") -> None:
    """``state`` (``program``'s: a Plan's) as a DCP directory that torch's documented flow
    (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``) reads into the torch model named by
    ``names`` and a ``torch.optim.AdamW`` built with the keyword arguments ``adamw`` (written as
    its param group; default torch's defaults). Whole tensors, process 0 writing (module doc);
    every process calls it."""
    import torch.distributed as dist

    if not isinstance(program, Program):
        raise ValueError(f"cfx.checkpoint.to_dcp: program is a {type(program).__name__}, not a Plan's Program "
                         "(plan.step(model, tx, mesh=mesh)); write one device's state through a Plan on that device.")
    torch_names = TorchNames(program.model, names)  # its errors before any collective
    shapes = program.layout.model_shapes
    roles = optimizer_roles(shapes, program.tx)
    group = _param_group(adamw or {}, torch_names.params)
    whole = program.whole(state)  # model coordinates, on process 0 (a collective under dist)
    if 0 in program.mesh.local_ranks:
        tree = _torch_state(whole, torch_names, shapes, roles)
        _save({model_key: tree["params"], optim_key: {"state": tree["state"], "param_groups": [group]}}, directory)
    if len(program.mesh.local_ranks) < program.mesh.size:
        dist.barrier()  # the others return once it is written


def _torch_state(whole: dict, torch_names: TorchNames, shapes: Any, roles: dict) -> dict:
    """``{"params": the torch state dict, "state": torch AdamW's per-param state}`` of the
    model-coordinate tensors ``whole``."""
    items, treedef = tree_util.flatten_with_path(shapes)
    by_role = {role: path for path, role in roles.items()}
    steps = [whole[path] for path, (name, _) in roles.items() if name == "step"]
    lacking = [(s, p) for s in MOMENTS.values() for p, _ in items if (s, p) not in by_role]
    if lacking or not steps:
        raise ValueError(f"cfx.checkpoint.to_dcp: the optimizer's state has no {lacking[:1] or 'count'}; "
                         "torch.optim.AdamW keeps exp_avg, exp_avg_sq and step for every param: train with "
                         "cfx.optim.adamw (or adam).")

    def torch_dict(leaf: Callable[[str], str]) -> dict:
        params = tree_util.unflatten(treedef, [whole[leaf(p)] for p, _ in items])
        return {k: _own(t) for k, t in torch_names.fn(params).items()}

    model = torch_dict(lambda p: f"params.{p}")
    moments = {s: torch_dict(lambda p, s=s: by_role[(s, p)]) for s in MOMENTS.values()}
    step = float(steps[0])
    state = {k: {"step": torch.tensor(step, dtype=torch.float32), **{s: moments[s][k] for s in MOMENTS.values()}}
             for k in torch_names.params}
    return {"params": model, "state": state}


def _param_group(adamw: dict, params: list[str]) -> dict:
    """torch.optim.AdamW's param group for ``adamw`` (its keyword arguments) over the keys ``params``."""
    try:
        group = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **adamw).param_groups[0])
    except (TypeError, ValueError) as e:
        raise ValueError(f"cfx.checkpoint.to_dcp: adamw={adamw!r} are not torch.optim.AdamW's keyword "
                         f"arguments ({e}); pass those the loading side builds its optimizer with (lr=, "
                         "weight_decay=, ...).") from None
    return {**group, "params": list(params)}


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous in storage of its own (DCP writes a tensor's whole storage)."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _save(state_dict: dict, directory: str | os.PathLike) -> None:
    """``dcp.save`` by this process alone (the others hold no state to write): DCP warns that it
    assumes so and that it overwrites a checkpoint already there, both what is meant here."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(os.fspath(directory)), no_dist=True)


def _read(reader: Any, metadata: Any, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
          ) -> dict[str, torch.Tensor]:
    """``{key: its box}`` of DCP tensors, read in this process alone through DCP's reader and planner
    protocol (what ``dcp.load`` runs, less its collectives): each stored shard overlapping a box is
    read and cut to it. ``reader`` was set up with the checkpoint's ``metadata``."""
    stored = metadata.state_dict_metadata
    out = {k: torch.empty(size, dtype=stored[k].properties.dtype) for k, (_, size) in boxes.items()}
    planner = _box_planner({k: lo for k, (lo, _) in boxes.items()})
    planner.set_up_planner(out, metadata, True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    plans = reader.prepare_global_plan(planner.create_global_plan([local]))
    reader.read_data(planner.finish_plan(plans[0]), planner).wait()
    return out


def _box_planner(offsets: dict[str, tuple[int, ...]]) -> Any:
    """A ``DefaultLoadPlanner`` that reads into each tensor the box of the stored one at ``offsets``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _BoxPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, t in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=t.size())
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return _BoxPlanner()


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _prefixes(stored: dict) -> str:
    """The checkpoint's top-level keys and a few of its tensors' keys, for error messages."""
    tops = sorted({k.split(".", 1)[0] for k in stored})
    return f"top-level keys {tops} (e.g. {sorted(stored)[:3]})"
