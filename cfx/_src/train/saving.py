"""The training job's checkpoints: ``--save`` (with ``--save-every``) writes them, ``--resume``
continues from one, and ``python -m cfx.generate`` reads the params back (``read_params``).

Every program saves the same thing, its state in *model coordinates*: ``params``, the model's tree,
and ``opt_state``, ``build_optimizer``'s state over those params -- what one device holds -- with
the step and the run's config as metadata. So a checkpoint resumes under any program: one device's,
any Plan's (another mesh, ZeRO stage or pipe axis), ``--auto``'s, and back. A Plan's program writes
``--save DIR`` as a sharded directory, every process its own regions, and ``--save FILE.safetensors``
as one file of whole tensors (``Program.save``); one device and ``--auto`` write one file at any
path (process 0). ``--resume`` reads either kind: a Plan's program each region its ranks hold
(``Program.load``), the others whole tensors (``put``).

Under ``--lora`` the trained state is the adapters and their optimizer state (the model is a
``LoraModel``; metadata ``"lora"`` says so and names the frozen base), and the base is built again
from the run's flags (``base_params``: ``--init-from``'s, or the model ``--seed`` initialises);
``read_params`` returns the base with the adapters merged. ``--save-peft DIR`` also writes the trained
adapters at the end as peft's adapter directory (``write_peft``).

A checkpoint of another model or optimizer is a ValueError that says what differs ("the checkpoint
has 4 blocks, the model 8") and the flags it was saved with. One written before every program ran
the same optimizer -- a mesh's, without the clip's place in the chain, or a Plan's or ``--auto``'s
file, with the program's clip in front -- holds the same leaves under other names: it is read under
today's (``_older_names``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from cfx._src.checkpoint.file import check_writable, open_stored, save as save_file
from cfx._src.checkpoint.sharded import INDEX
from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.lora.adapters import merge
from cfx._src.lora.config import LoraConfig
from cfx._src.lora.model import LoraModel
from cfx._src.lora.peft import WEIGHTS, check_peft, save_peft
from cfx._src.models.hf_dir import from_pretrained, model_of_directory
from cfx._src.models.parts import vocab_size
from cfx._src.optim.base import chain, identity
from cfx._src.plan.program import Program
from cfx._src.plan.saving import model_leaves, state_differences
from cfx._src.precision.quant import dequantize
from cfx._src.spmd.arrays import device_get
from cfx._src.train.config import TrainConfig
from cfx._src.train.data import VOCAB_SIZE, run_keys
from cfx._src.train.model import build_model, build_optimizer, check_context, job_base, lora_model, padded_vocab
from cfx._src.transforms.shapes import eval_shape

# the flags that decide the state's leaves (the others -- learning rate, clip, mesh, ... -- do not)
STATE_FLAGS = ("model", "preset", "precision", "lora")


def sharded_save(cfg: TrainConfig) -> bool:
    """``--save`` names a directory of every process's regions (module doc), not one file."""
    return bool(cfg.mesh) and not cfg.auto and not cfg.save.endswith(".safetensors")


def check_save(cfg: TrainConfig) -> None:
    """ValueError now, not after the last step, if ``--save``, ``--save-hf`` or ``--plot`` cannot be written."""
    if cfg.save:
        check_writable(os.path.join(cfg.save, "index.json") if sharded_save(cfg) else cfg.save, what="--save")
    if cfg.save_hf:
        check_writable(os.path.join(cfg.save_hf, "config.json"), what="--save-hf")
    if cfg.plot:
        check_writable(cfg.plot, what="--plot")


def check_peft_out(cfg: TrainConfig, model: Any) -> None:
    """ValueError now, not after the last step, if ``--save-peft`` cannot hold ``model``'s adapters
    (peft's layout has no module for one of them) or cannot be written."""
    if cfg.save_peft:
        check_peft(model.model, model.lora, f"--save-peft {cfg.save_peft!r}")
        check_writable(os.path.join(cfg.save_peft, WEIGHTS), what="--save-peft")


def write_peft(cfg: TrainConfig, model: Any, adapters: Any, *, is_main: bool) -> None:
    """``--save-peft``: ``adapters`` (the trained ones, whole: every process gathered them) as a peft
    adapter directory of ``model``'s base (``cfx.lora.save_peft``), written by process 0."""
    if cfg.save_peft and is_main:
        save_peft(cfg.save_peft, model.model, adapters, model.lora)


def check_resume(cfg: TrainConfig, model: Any, shapes: Any) -> None:
    """ValueError now, before any state is built, if ``--resume``'s checkpoint is missing, damaged
    or holds another model's or optimizer's state (its index or header is all that is read)."""
    if cfg.resume:
        with open_stored(cfg.resume) as stored:
            _checked(stored, cfg, model, shapes)


def resume(cfg: TrainConfig, program: Any, state: Any, model: Any, shapes: Any) -> tuple[Any, int]:
    """``(state, the step to start from)``: ``--resume``'s checkpoint, written by any program,
    read into ``program``'s ``state`` (the model's params are ``shapes``), or ``(state, 0)`` without
    ``--resume``; ValueError naming what differs if it holds another model's or optimizer's state."""
    if not cfg.resume:
        return state, 0
    with open_stored(cfg.resume) as stored:
        stored = _checked(stored, cfg, model, shapes)
        if isinstance(program, Program):  # each process reads the regions its ranks hold
            state, meta = program.load(stored, state)
        else:  # one device's state is the model coordinates; --auto's is laid out by put
            like = model_state(cfg, model, shapes)
            items, treedef = tree_util.flatten_with_path(like)
            whole = tree_util.unflatten(treedef, [stored.region(p, (0,) * len(x.shape), tuple(x.shape))
                                                  for p, x in items])
            state, meta = program.put(whole["params"], whole["opt_state"]), stored.metadata
    return state, int(meta.get("step", 0))


def save(cfg: TrainConfig, program: Any, state: Any, step: int, *, is_main: bool) -> None:
    """``state`` at ``step`` to ``--save`` in model coordinates (every process calls it; module doc);
    with ``--async-save`` it returns once the state is copied to host memory (``background``)."""
    meta = {"step": step, "config": dataclasses.asdict(cfg)}
    if cfg.lora:  # the state is the adapters alone: say so, and over which frozen base
        meta["lora"] = {"adapters": cfg.lora, "base": _base_name(cfg), "stored": cfg.lora_base or cfg.precision}
    if isinstance(program, Program):  # a directory of every process's regions, or one file
        program.save(cfg.save, state, metadata=meta, async_=cfg.async_save)
        return
    out = {"params": program.params(state), "opt_state": device_get(state.opt_state)}  # every process joins
    if is_main:
        save_file(cfg.save, out, metadata=meta, async_=cfg.async_save)


def resume_auto(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``--resume auto``: ``(the config with --resume set to --save's committed checkpoint, or unset
    when there is none yet, a note for the user)``; other configs as they are. Every process sees
    the same files (nothing writes them before the first step), so all decide alike."""
    if cfg.resume != "auto":
        return cfg, None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    again = f" (torchrun's restart {restart})" if restart else ""
    if not committed(cfg.save):
        return (dataclasses.replace(cfg, resume=None),
                f"note: --resume auto: no committed checkpoint at {cfg.save!r} yet; starting from step 0{again}.")
    with open_stored(cfg.save) as stored:
        step = stored.metadata.get("step", "?")
    return (dataclasses.replace(cfg, resume=cfg.save),
            f"note: --resume auto: continuing from {cfg.save!r} at step {step}{again}.")


def committed(path: str) -> bool:
    """Whether ``path`` holds a committed checkpoint: a file, or a directory with its index."""
    return os.path.isfile(os.path.join(path, INDEX)) if os.path.isdir(path) else os.path.isfile(path)


def model_state(cfg: TrainConfig, model: Any, shapes: Any) -> dict[str, Any]:
    """The shapes of a checkpoint's trees: ``{"params": shapes, "opt_state": its optimizer's state}``."""
    return {"params": shapes, "opt_state": eval_shape(build_optimizer(cfg, model).init, shapes)}


def _checked(stored: Any, cfg: TrainConfig, model: Any, shapes: Any) -> Any:
    """``stored`` (an open checkpoint) if it holds this run's model and optimizer state, under
    today's names (module doc); else a ValueError saying what differs."""
    want = model_leaves(shapes, build_optimizer(cfg, model))
    have = {path: (stored.shape(path), stored.dtype(path)) for path in stored.leaves}
    if have == want:
        _check_base(stored, cfg)
        return stored
    for names in _older_names(cfg, model, shapes):
        if set(names.values()) == set(have) and all(have[theirs] == want[ours] for ours, theirs in names.items()):
            return _Renamed(stored, names)
    saved = stored.metadata.get("config") or {}
    flags = [f for f in STATE_FLAGS if f in saved and saved[f] != getattr(cfg, f)]
    said = (f" (it was saved with {_flags(saved.get, flags)}; this run has {_flags(lambda f: getattr(cfg, f), flags)})"
            if flags else "")
    raise ValueError(f"--resume {stored.path!r}: {state_differences(have, want)}{said}. Resume with the --model, "
                     "--preset and --precision that saved it (the mesh and the strategy flags may differ).")


def _check_base(stored: Any, cfg: TrainConfig) -> None:
    """ValueError if ``stored`` holds adapters trained over another frozen base than this run's."""
    saved = stored.metadata.get("lora")
    if saved and cfg.lora and saved.get("base") != _base_name(cfg):
        raise ValueError(f"--resume {stored.path!r} holds adapters trained over {saved.get('base')}, but this run's "
                         f"frozen base is {_base_name(cfg)}; resume with the --init-from (or --model, --preset and "
                         "--seed) that saved it.")


def _base_name(cfg: TrainConfig) -> str:
    if cfg.init_from:
        return f"--init-from {os.path.abspath(cfg.init_from)}"
    return f"--model {cfg.model} --preset {cfg.preset} --seed {cfg.seed}"


def base_params(cfg: TrainConfig) -> tuple[Any, Any]:
    """``(model, params)`` of ``--lora``'s frozen base before ``--lora-base`` stores it: ``--init-from``'s
    (a Hugging Face directory, or a ``python -m cfx.train`` checkpoint: ``read_params``), else ``--model``
    at ``--preset`` initialised from ``fold_in(the run's init key, 1)`` (its adapters take the init key)."""
    path = cfg.init_from
    if not path:
        model = build_model(cfg)
        return model, model.init(jr.fold_in(run_keys(cfg.seed).init, 1))
    model, params = from_pretrained(path) if _is_hf(cfg) else read_params(path)
    model, params = padded_vocab(cfg, model, params)
    return _checked_base(cfg, model), params


def init_model(cfg: TrainConfig) -> Any:
    """The model of ``--init-from`` from its config alone (no weights read), padded as ``--pad-vocab`` says."""
    if _is_hf(cfg):
        model = model_of_directory(cfg.init_from)
    else:
        with open_stored(cfg.init_from) as stored:
            model = _model_of(cfg.init_from, stored.metadata)[1]
        model = model.model if isinstance(model, LoraModel) else model  # (read_params merges its adapters)
    return _checked_base(cfg, padded_vocab(cfg, model))


def _is_hf(cfg: TrainConfig) -> bool:
    """Whether ``--init-from`` is a Hugging Face directory (else a checkpoint); ValueError if neither."""
    path = cfg.init_from
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return True
    if committed(path):
        return False
    raise ValueError(f"--init-from {path!r}: neither a Hugging Face model directory (with config.json) nor a "
                     "python -m cfx.train checkpoint (a file, or a directory with index.json).")


def _checked_base(cfg: TrainConfig, model: Any) -> Any:
    """``--init-from``'s ``model``, or a ValueError where the job's data or ``--seq`` cannot feed it."""
    path, vocab = cfg.init_from, vocab_size(model)
    if not cfg.tokenizer and vocab < VOCAB_SIZE:
        raise ValueError(f"--init-from {path!r}: a vocabulary of {vocab} cannot read the job's {VOCAB_SIZE} byte ids; "
                         f"fine-tune a model of {VOCAB_SIZE} tokens or more, or read --data with its --tokenizer.")
    if not cfg.tokenizer and _is_hf(cfg) and vocab > VOCAB_SIZE:
        raise ValueError(f"--init-from {path!r}: a pretrained vocabulary of {vocab} tokens, but --data is read as "
                         f"bytes (ids 0-255, another language to it): add --tokenizer DIR (the model's own, e.g. "
                         f"--tokenizer {path}).")
    return check_context(cfg, model, f"--init-from {path!r}")


def _flags(value, names: list[str]) -> str:
    return " ".join(f"--{n} {value(n)}" for n in names)


def _older_names(cfg: TrainConfig, model: Any, shapes: Any) -> list[dict[str, str]]:
    """``{today's path: the path an earlier version saved the same leaf under}`` for each way it
    did: a mesh's state of the optimizer without the clip's place (the clip was the program's),
    and a Plan's or ``--auto``'s file of its own state, that clip chained in front. The clips hold
    no state, so the leaves are the same, in the same order."""
    ours = list(model_leaves(shapes, build_optimizer(cfg, model)))
    bare = build_optimizer(cfg, model, clip_slot=False)
    return [dict(zip(ours, model_leaves(shapes, tx))) for tx in (bare, chain(identity(), bare))]


class _Renamed:
    """An open checkpoint (``stored``) whose leaves read under today's names (``names``: ours -> its)."""

    def __init__(self, stored: Any, names: dict[str, str]):
        self._stored, self._names = stored, names
        self.path, self.metadata, self.leaves = stored.path, stored.metadata, list(names)

    def shape(self, path: str) -> tuple[int, ...]:
        return self._stored.shape(self._names[path])

    def dtype(self, path: str):
        return self._stored.dtype(self._names[path])

    def region(self, path: str, lo: tuple[int, ...], size: tuple[int, ...]):
        return self._stored.region(self._names[path], lo, size)


def read_params(path: str) -> tuple[Any, Any]:
    """``(model, params)`` of a checkpoint ``python -m cfx.train`` wrote: one file, or the directory
    of a run on a mesh under any plan (its params are in the model's own coordinates), as whole
    tensors; ValueError if ``path`` is not one."""
    with open_stored(path) as stored:
        cfg, model = _model_of(path, stored.metadata)
        items, treedef = tree_util.flatten_with_path(eval_shape(model.init, jr.key(0)))
        params = tree_util.unflatten(treedef, [stored.region(f"params.{p}", (0,) * x.dim(), tuple(x.shape))
                                               for p, x in items])
    if not isinstance(model, LoraModel):
        return model, params
    # the base as the run held it (int8 weights read back as what they stand for), the adapters merged in fp32
    base = tree_util.map(lambda x: x.float(), dequantize(model.base))
    return model.model, merge(base, params, model.lora)


def _model_of(path: str, meta: dict) -> tuple[TrainConfig, Any]:
    """``(the run's config, the model whose params it saved)`` from a checkpoint's metadata."""
    if "config" not in meta:
        raise ValueError(f"--checkpoint {path!r}: not a python -m cfx.train checkpoint (no training config in "
                         "its metadata); pass a Hugging Face directory instead.")
    cfg = TrainConfig(**{k: v for k, v in meta["config"].items() if k in TrainConfig.__dataclass_fields__})
    return cfg, trained_model(cfg)


def trained_model(cfg: TrainConfig) -> Any:
    """The model a run of ``cfg`` trains: ``--model`` at ``--preset`` (a full fine-tune: ``--init-from``'s),
    or under ``--lora`` the adapters over its frozen base (``base_params``, stored as ``--lora-base`` says)."""
    if not cfg.lora:
        return init_model(cfg) if cfg.init_from else build_model(cfg)
    model, params = base_params(cfg)
    return lora_model(model, LoraConfig.parse(cfg.lora), job_base(cfg, model, params))
