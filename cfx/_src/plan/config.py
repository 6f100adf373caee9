"""``Plan``'s fields, its text form and the checks that need no model.

    Plan.parse("pipe=2,data=2,model=2 zero=2 remat=blocks microbatches=4")

The text is whitespace-separated groups of comma-separated ``key=value`` pairs; a key that is a
mesh axis (``pipe``, ``data``, ``expert``, ``seq``, ``model``) sets that axis's size, in the order
given. ``expert`` splits a mixture of experts' experts, and the batch's rows with ``data`` (the
peers' expert parallelism folded into data parallelism). ``row``, ``col`` and ``dep`` are the grid
of ``tp=2d`` (``row`` x ``col``), ``tp=2.5d`` and ``tp=3d`` (``row`` x ``col`` x ``dep``): 2D / 2.5D /
3D tensor parallelism of every block (``cfx.parallel.tensor_parallel_grid``), with ``data``.
``sp=`` names the sequence parallelism: ``ring`` (the default with a ``seq`` axis) or ``ulysses``
over ``seq``, or ``megatron`` over ``model`` (Megatron-SP, no ``seq`` axis).
``remat=auto:512MiB`` / ``offload=auto:64MiB`` carry their budgets. ``str(plan)`` writes the
canonical form (defaults left out) and ``Plan.parse(str(plan)) == plan``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from cfx._src.core.text import format_bytes, parse_bytes
from cfx._src.plan import strategies


def plan_axes() -> tuple[str, ...]:
    """The mesh axes a Plan takes: those its strategies own (``strategies.STRATEGIES``), in list order."""
    return tuple(a for s in strategies.STRATEGIES for a in s.axes)

GRID_SCHEMES = ("2d", "2.5d", "3d")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "host", "nvme", "auto")
REMATS = ("none", "blocks", "dots", "auto")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
FP8_COMMS = ("all_gather", "reduce_scatter", "pipe")  # fp8_comm's parts, joined by "+" (or "none")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8:tensorwise", "fp8:rowwise", "fp8:rowwise_gw_hp", "fp8:delayed")
SEQUENCE_METHODS = ("none", "ring", "ulysses", "megatron")


def parse_mesh(text: str, *, axes: tuple[str, ...] | None = None, where: str | None = None,
               fix: str = "") -> tuple[tuple[str, int], ...]:
    """``"data=2,model=2"`` -> ``(("data", 2), ("model", 2))``: comma-separated ``AXIS=SIZE``, each
    AXIS one of ``axes`` once, each SIZE a positive integer, in the order given. The one reader of
    mesh text: ``Plan.parse``'s axes and every command line's ``--mesh``. A ValueError starts with
    ``where`` (default ``--mesh 'TEXT'``) and ends with ``fix`` (what that caller takes)."""
    where = f"--mesh {text!r}" if where is None else where
    axes = plan_axes() if axes is None else axes
    mesh: list[tuple[str, int]] = []
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if name not in axes or not eq:
            raise ValueError(f"{where}: expected comma-separated AXIS=SIZE with AXIS in {axes}{fix or '.'}")
        if not size.isdigit():
            raise ValueError(f"{where}: {name}={size!r} is not a non-negative integer{fix or '.'}")
        if int(size) < 1:
            raise ValueError(f"{where}: {name}={size}: mesh axis sizes are positive integers{fix or '.'}")
        if name in dict(mesh):
            raise ValueError(f"{where}: axis {name!r} appears twice{fix or '.'}")
        mesh.append((name, int(size)))
    return tuple(mesh)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The strategy as data; ``Plan`` adds the methods (see ``plan.py``)."""

    mesh: tuple[tuple[str, int], ...] = ()     # (axis, size) in the order given; () is one device
    zero: int = 0                              # ZeRO stage over ``data``
    offload: str = "none"                      # Gemini placement of ZeRO-3 chunks
    offload_budget: int | None = None          # device bytes for offload=auto (None: what is free)
    remat: str = "none"                        # activation checkpointing per block, or auto (Rotor)
    remat_budget: int | None = None            # activation bytes for remat=auto
    schedule: str = "1f1b"                     # pipeline schedule (with a pipe axis)
    microbatches: int = 1                      # per step, with a pipe axis
    chunks: int = 1                            # virtual stages per pipe rank (interleaved)
    precision: str = "fp32"
    sp: str | None = None                      # sequence parallelism; None: ring with a seq axis, else none
    tp: str | None = None                      # 2d | 2.5d | 3d: grid tensor parallelism over row, col (, dep)
    fp8_comm: str = "none"                     # all_gather: ZeRO-3 gathers float8 weights as their e4m3 casts;
                                               # reduce_scatter: its gradients go as e5m2 (an all-to-all);
                                               # pipe: stages send activations as e4m3; several: joined by +

    def __post_init__(self):
        mesh = self.mesh
        if isinstance(mesh, Mapping):
            mesh = tuple(mesh.items())
        object.__setattr__(self, "mesh", tuple((str(a), s) for a, s in mesh))
        for name in ("offload_budget", "remat_budget"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, parse_bytes(v))
        if self.sp is None:
            object.__setattr__(self, "sp", self.default_sp)
        if self.fp8_comm != "none":  # one spelling per set of parts
            parts = self.fp8_comm.split("+")
            object.__setattr__(self, "fp8_comm", "+".join(sorted(parts, key=lambda p: (
                FP8_COMMS.index(p) if p in FP8_COMMS else len(FP8_COMMS), p))))
        if self.schedule == "interleaved" and self.chunks == 1:
            object.__setattr__(self, "chunks", 2)
        self._check()

    # -- the mesh ---------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.mesh)

    def size(self, axis: str) -> int:
        return self.mesh_shape.get(axis, 1)

    def has(self, axis: str) -> bool:
        return axis in self.mesh_shape

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's rows are split over: ``data`` and ``expert`` (each rank's own rows)."""
        return tuple(a for a in ("data", "expert") if self.has(a))

    @property
    def default_sp(self) -> str:
        return "ring" if self.has("seq") else "none"

    @property
    def sequence_axis(self) -> str | None:
        """The mesh axis the sequence is split over: ``seq``, ``model`` (Megatron-SP) or None."""
        return {"ring": "seq", "ulysses": "seq", "megatron": "model"}.get(self.sp)

    @property
    def home(self) -> str:
        """Where the model state lives: ``device``, or with offload ``host`` (``host``, ``auto``) or ``nvme``."""
        return {"none": "device", "nvme": "nvme"}.get(self.offload, "host")

    # -- checks that need no model ----------------------------------------------------------------
    def _check(self) -> None:
        """The fields' own values here; how they combine, each strategy's ``check_plan``."""
        axes = plan_axes()
        names = [a for a, _ in self.mesh]
        for a, s in self.mesh:
            if a not in axes:
                raise ValueError(f"Plan: unknown mesh axis {a!r}; a Plan's axes are {axes}.")
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"Plan: axis {a!r} has size {s!r}; sizes are positive ints.")
        dup = sorted({a for a in names if names.count(a) > 1})
        if dup:
            raise ValueError(f"Plan: axis {dup[0]!r} appears twice in the mesh {list(self.mesh)}.")
        _one_of("zero", self.zero, ZERO_STAGES)
        _one_of("offload", self.offload, OFFLOADS)
        _one_of("remat", self.remat, REMATS)
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("precision", self.precision, PRECISIONS)
        parts = self.fp8_comm.split("+")
        if self.fp8_comm != "none" and (not set(parts) <= set(FP8_COMMS) or len(set(parts)) != len(parts)):
            raise ValueError(f"Plan: fp8_comm={self.fp8_comm!r}; use none, or one or more of {', '.join(FP8_COMMS)} "
                             "joined by + (e.g. all_gather+reduce_scatter).")
        for name in ("microbatches", "chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Plan: {name}={v!r}; use a positive int.")
        _one_of("sp", self.sp, SEQUENCE_METHODS)
        if self.tp is not None:
            _one_of("tp", self.tp, GRID_SCHEMES)
        for strategy in strategies.STRATEGIES:
            strategy.check_plan(self)

    @property
    def grid_rows(self) -> int:
        """How many ranks of the grid split each data rank's rows inside a block (1 without ``tp``)."""
        if self.tp is None:
            return 1
        return self.size("row") * (self.size("dep") if self.tp != "2d" else 1)

    def check_batch(self, rows: int, length: int | None = None) -> None:
        """ValueError unless a global batch of ``rows`` splits over ``data`` and then into the
        pipeline's microbatches, and sequences of ``length`` over the sequence axis."""
        data = self.size("data") * self.size("expert")  # the rows split over both
        axis = self.sequence_axis
        if length is not None and axis is not None:
            n = self.size(axis)
            step = 2 * n if self.sp == "ring" else n  # the ring's zigzag: two chunks per rank
            if length % step:
                raise ValueError(f"Plan {str(self)!r}: sequences of {length} positions do not split over "
                                 f"{axis}={n} (sp={self.sp}{', two zigzag chunks per rank' if step > n else ''}); "
                                 f"use a length that is a multiple of {step}, padding the rest with masked "
                                 "positions (targets -100).")
        if rows % data:
            over = " x ".join(f"{a}={self.size(a)}" for a in self.batch_axes)
            raise ValueError(f"Plan {str(self)!r}: the batch of {rows} rows does not split over {over}; "
                             f"use a multiple of {data}.")
        if (rows // data) % self.grid_rows:
            raise ValueError(f"Plan {str(self)!r}: each data rank's {rows // data} rows do not split over the "
                             f"{self.grid_rows} ranks of the tp={self.tp} grid that split a block's batch; use a "
                             f"batch of a multiple of {data * self.grid_rows} rows.")
        if self.has("pipe") and (rows // data) % self.microbatches:
            raise ValueError(f"Plan {str(self)!r}: each data rank's {rows // data} rows do not split into "
                             f"microbatches={self.microbatches}; use a batch of a multiple of "
                             f"{data * self.microbatches} rows.")

    # -- text ---------------------------------------------------------------------------------------
    def __str__(self) -> str:
        d = PlanConfig()
        groups = [",".join(f"{a}={s}" for a, s in self.mesh)] if self.mesh else []
        if self.zero != d.zero:
            groups.append(f"zero={self.zero}")
        if self.offload != d.offload:
            tail = f":{format_bytes(self.offload_budget, exact=True)}" if self.offload_budget is not None else ""
            groups.append(f"offload={self.offload}{tail}")
        if self.remat != d.remat:
            tail = f":{format_bytes(self.remat_budget, exact=True)}" if self.remat_budget is not None else ""
            groups.append(f"remat={self.remat}{tail}")
        if self.schedule != d.schedule:
            groups.append(f"schedule={self.schedule}")
        if self.microbatches != d.microbatches:
            groups.append(f"microbatches={self.microbatches}")
        if self.chunks != (2 if self.schedule == "interleaved" else 1):
            groups.append(f"chunks={self.chunks}")
        if self.precision != d.precision:
            groups.append(f"precision={self.precision}")
        if self.sp != self.default_sp:
            groups.append(f"sp={self.sp}")
        if self.tp is not None:
            groups.append(f"tp={self.tp}")
        if self.fp8_comm != d.fp8_comm:
            groups.append(f"fp8_comm={self.fp8_comm}")
        return " ".join(groups) or "single-device"

    @classmethod
    def parse_fields(cls, text: str) -> dict[str, Any]:
        """The keyword arguments ``text`` names (module doc)."""
        if not isinstance(text, str):
            raise ValueError(f"Plan.parse: expected the plan's text, got {type(text).__name__}.")
        if text.strip() == "single-device":
            return {}
        axes, kw = [], {}
        for pair in text.replace(",", " ").split():
            key, eq, value = pair.partition("=")
            if not eq or not value:
                raise ValueError(f"Plan.parse({text!r}): {pair!r} is not key=value; e.g. "
                                 "'pipe=2,data=2 zero=1 remat=blocks microbatches=4'.")
            if key in kw:
                raise ValueError(f"Plan.parse({text!r}): {key} is given twice.")
            if key in plan_axes():  # the mesh's pairs, in the order given, read by parse_mesh below
                axes.append(pair)
            elif key in ("zero", "microbatches", "chunks"):
                kw[key] = _int(text, key, value)
            elif key in ("offload", "remat"):
                mode, _, budget = value.partition(":")
                kw[key] = mode
                if budget:
                    kw[f"{key}_budget"] = budget
            elif key in ("schedule", "precision", "sp", "tp", "fp8_comm"):
                kw[key] = value
            else:
                raise ValueError(f"Plan.parse({text!r}): unknown key {key!r}; keys are the axes {plan_axes()} "
                                 "and zero, offload, remat, schedule, microbatches, chunks, precision, sp, tp, fp8_comm.")
        return dict(kw, mesh=parse_mesh(",".join(axes), where=f"Plan.parse({text!r})") if axes else ())


def _int(text: str, key: str, value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"Plan.parse({text!r}): {key}={value!r} is not a non-negative integer.")
    return int(value)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"Plan: {name}={value!r}; use one of {', '.join(map(str, allowed))}.")
