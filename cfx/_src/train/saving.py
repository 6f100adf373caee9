"""The training job's checkpoints: ``--save`` (with ``--save-every``) writes them, ``--resume``
continues from one, and ``python -m cfx.generate`` reads the params back (``read_params``).

A checkpoint holds ``params`` and ``opt_state``, with the step and the run's config as metadata.
A Plan's program on a mesh writes ``--save DIR`` as a sharded directory: every process writes its
own blocks, in the model's coordinates (``Program.save``), and ``--resume DIR`` reads them onto any
other plan of the same model and optimizer. ``--save FILE.safetensors`` -- and any path of a
one-device or ``--auto`` run -- is one file of whole tensors (every process joins the gather,
process 0 writes), whose optimizer state is the running program's.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from cfx._src.checkpoint.file import check_writable, load, save as save_file
from cfx._src.checkpoint.sharded import Stored
from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.spmd.arrays import device_get
from cfx._src.train.config import TrainConfig
from cfx._src.train.model import build_model
from cfx._src.transforms.shapes import ShapeDtype, eval_shape


def _plan_on_mesh(cfg: TrainConfig) -> bool:
    """A Plan's program (``Program``: sharded save and load), not one device's nor ``--auto``'s."""
    return bool(cfg.mesh) and not cfg.auto


def sharded_save(cfg: TrainConfig) -> bool:
    """``--save`` names a directory of every process's blocks (module doc), not one file."""
    return _plan_on_mesh(cfg) and not cfg.save.endswith(".safetensors")


def check_save(cfg: TrainConfig) -> None:
    """ValueError now, not after the last step, if ``--save`` cannot be written."""
    if cfg.save:
        check_writable(os.path.join(cfg.save, "index.json") if sharded_save(cfg) else cfg.save, what="--save")


def resume(cfg: TrainConfig, program: Any, state: Any, shapes: Any) -> tuple[Any, int]:
    """``(state, the step to start from)``: ``--resume``'s checkpoint read into ``program``'s
    ``state`` (the model's params are ``shapes``), or ``(state, 0)`` without ``--resume``."""
    if not cfg.resume:
        return state, 0
    if _plan_on_mesh(cfg) and os.path.isdir(cfg.resume):  # a sharded checkpoint: each process reads its blocks
        state, meta = program.load(cfg.resume, state)
    else:  # one file of whole tensors: the saved optimizer state is this program's
        like = {"params": shapes, "opt_state": tree_util.map(lambda a: ShapeDtype(a.shape, a.dtype), state.opt_state)}
        restored, meta = load(cfg.resume, like)
        state = program.put(restored["params"], restored["opt_state"])
    return state, int(meta.get("step", 0))


def save(cfg: TrainConfig, program: Any, state: Any, step: int, *, is_main: bool) -> None:
    """``state`` at ``step`` to ``--save`` (every process calls it; module doc)."""
    meta = {"step": step, "config": dataclasses.asdict(cfg)}
    if sharded_save(cfg):  # every process writes its own blocks
        program.save(cfg.save, state, metadata=meta)
        return
    out = {"params": program.params(state), "opt_state": device_get(state.opt_state)}  # every process joins
    if is_main:
        save_file(cfg.save, out, metadata=meta)


def read_params(path: str) -> tuple[Any, Any]:
    """``(model, params)`` of a checkpoint ``python -m cfx.train`` wrote: one file, or the directory
    of a run on a mesh under any plan (its params are in the model's own coordinates), as whole
    tensors; ValueError if ``path`` is not one."""
    if os.path.isdir(path):
        with Stored(path) as stored:
            model, items, treedef = _params_of(path, stored.metadata)
            return model, tree_util.unflatten(treedef, [stored.region(f"params.{p}", (0,) * x.dim(), tuple(x.shape))
                                                        for p, x in items])
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        model, items, treedef = _params_of(path, json.loads((f.metadata() or {}).get("cfx", "{}")))
        return model, tree_util.unflatten(treedef, [f.get_tensor(f"params.{p}") for p, _ in items])


def _params_of(path: str, meta: dict) -> tuple[Any, list, Any]:
    """``(model, [(path, shape)], treedef)`` of the params a checkpoint's metadata describes."""
    if "config" not in meta:
        raise ValueError(f"--checkpoint {path!r}: not a python -m cfx.train checkpoint (no training config in "
                         "its metadata); pass a Hugging Face directory instead.")
    fields = {k: v for k, v in meta["config"].items() if k in TrainConfig.__dataclass_fields__}
    model = build_model(TrainConfig(**fields))
    items, treedef = tree_util.flatten_with_path(eval_shape(model.init, jr.key(0)))
    return model, items, treedef
