"""Delayed scaling, Transformer Engine's ``DelayedScaling``: a float8 cast takes the scale that earlier steps'
amaxes gave, and notes this step's amax for the steps after.

Each float8 Linear has three *slots*, the tensors it casts: its input ``x`` and weight ``w`` (e4m3) and its
output's gradient ``gy`` (e5m2) -- the ``tensorwise`` recipe's casts, each tensor's one scale serving both
of the GEMMs it enters. Per slot the state holds an amax history of ``history`` entries and the scale in use
(``Fp8Meta``: ``history`` ``(L, M)``, ``scale`` ``(M,)``, fp32; at first zeros and ones). A step casts with
the scales, and ``Step`` notes each slot's amax: the largest over the step's casts of it (every microbatch)
and, at the step's end, over every rank (one all-reduce of all the slots' amaxes, as TE reduces them). Then
``update``, TE's rule (its ``amax_and_scale_update`` kernel), per slot::

    last = h[0]                           this step's amax (what the step noted)
    h' = roll(h, -1), h'[0] = 0           the oldest entry dropped, last moved to h'[L - 1]
    amax = max(h) ("max", nan entries passed over as fmaxf does) or last ("most_recent")
    scale' = fmax * 2**-margin / amax     in fp32, where amax is finite and > 0; else scale' = scale

The meta lives in the optimizer's state (``cfx._src.optim.fp8_meta.meta_state``: a transformation whose
state it is and whose updates pass through), so checkpoints hold it and a resumed run goes on bit for bit; a Plan with
``precision=fp8:delayed`` chains it in front of its optimizer and runs every step in a ``Step``. Scales
come from the past, not the tensor at hand, so how a mesh splits a tensor never changes them: a rank's
float8 operands are one device's, whatever its pieces.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch

from cfx._src.core import context
from cfx._src.lax import comm, groups
from cfx._src.nn.fp8 import E4M3, E5M2

ALGOS = ("max", "most_recent")
KINDS = (E4M3, E4M3, E5M2)  # a Linear's slots: x, w, gy


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """TE's recipe knobs: ``history`` entries of amax per slot, the amax taken as their ``max`` or the
    ``most_recent``, and ``margin`` (scales divided by ``2**margin``). TE's defaults."""

    history: int = 1024
    algo: str = "max"
    margin: float = 0.0

    def __post_init__(self):
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"cfx.amp delayed scaling: history={self.history!r}; use a positive int (TE: 1024).")
        if self.algo not in ALGOS:
            raise ValueError(f"cfx.amp delayed scaling: algo={self.algo!r}; use one of {', '.join(ALGOS)}.")
        if not self.margin >= 0:
            raise ValueError(f"cfx.amp delayed scaling: margin={self.margin!r}; use a number >= 0.")


class Fp8Meta(NamedTuple):
    """Delayed scaling's state (module doc): ``history`` ``(L, M)`` and ``scale`` ``(M,)``, fp32."""

    history: torch.Tensor
    scale: torch.Tensor


def init_meta(slots: int, cfg: DelayedScaling) -> Fp8Meta:
    return Fp8Meta(torch.zeros(cfg.history, slots), torch.ones(slots))


def fp8_max(slots: int) -> torch.Tensor:
    """Each slot's float8 range (x, w: e4m3's 448; gy: e5m2's 57344), fp32."""
    return torch.tensor([torch.finfo(k).max for k in KINDS] * (slots // 3), dtype=torch.float32)


def update(meta: Fp8Meta, amax: torch.Tensor, cfg: DelayedScaling) -> Fp8Meta:
    """The meta after a step whose slots' amaxes were ``amax`` ``(M,)`` (TE's rule, module doc)."""
    h = meta.history.clone()
    h[0] = amax.float()
    rolled = torch.roll(h, -1, 0)
    chosen = torch.where(rolled.isnan(), 0.0, rolled).amax(0) if cfg.algo == "max" else h[0]  # (fmaxf: no nan)
    rolled[0] = 0
    scaled_max = fp8_max(h.shape[1]) * torch.tensor(2.0, dtype=torch.float32) ** -cfg.margin
    ok = torch.isfinite(chosen) & (chosen > 0)
    return Fp8Meta(rolled, torch.where(ok, scaled_max / torch.where(ok, chosen, 1.0), meta.scale))


# -- one step's scales and amaxes -------------------------------------------------------------------------
class Step:
    """The scales a step casts with (``meta.scale``) and the amaxes it notes (``amax``, ``(M,)``), both in one
    device's units: where a rank's loss is the mean of its ``1/rows`` of the batch's rows, its gradients are
    ``rows`` times one device's, so it casts them with ``scale / rows`` and notes ``amax / rows`` -- the same float8
    values as one device (exactly for a power of two), and the same meta on any mesh."""

    def __init__(self, meta: Fp8Meta, rows: int = 1):
        self.meta, self.rows = meta, rows
        self.amax = torch.zeros_like(meta.scale)
        self.scale = meta.scale.clone()
        if rows != 1:
            self.scale[2::3] /= rows

    def observe(self, slot: int, t: torch.Tensor) -> None:
        with torch.no_grad():
            a = t.detach().abs().amax().float()
            if slot % 3 == 2 and self.rows != 1:
                a = a / self.rows
            self.amax[slot] = torch.maximum(self.amax[slot], a)

    def finish(self, cfg: DelayedScaling, axes: tuple[str, ...] = ()) -> Fp8Meta:
        """The meta for the next step: the amaxes taken over the ranks of ``axes`` (all of a mesh's), then
        ``update``."""
        amax = self.amax if not axes else comm.all_reduce(self.amax, groups.axes(tuple(axes), "cfx fp8 amax"), "max")
        return update(self.meta, amax, cfg)


_STEP: context.Var["Step | None"] = context.Var("cfx.fp8.step", None)


@contextlib.contextmanager
def step_scope(meta: Fp8Meta, rows: int = 1):
    """Inside, a delayed-scaling Linear casts with ``meta``'s scales and notes its amaxes in the yielded
    ``Step`` (forward and backward: differentiate inside); ``step.finish(cfg, axes)`` then gives the next meta.
    ``rows``: how many ranks split the batch's rows (``Step``)."""
    step = Step(meta, rows)
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


@dataclasses.dataclass(frozen=True)
class Slots:
    """A Linear's three slots, ``base`` to ``base + 2`` (x, w, gy), read from the active ``step_scope``."""

    base: int

    def _step(self) -> Step:
        step = _STEP.get()
        if step is None:
            raise ValueError("a delayed-scaling float8 Linear ran outside a step: run the loss and its gradient "
                             "inside cfx.amp.fp8_step(meta) (a Plan with precision=fp8:delayed does), meta from "
                             "cfx.amp.fp8_meta(opt_state).")
        if self.base + 3 > step.meta.scale.numel():
            raise ValueError(f"delayed scaling: the model's Linear at slots {self.base}..{self.base + 2} is past the "
                             f"{step.meta.scale.numel()} slots of the meta; make the meta for this model "
                             "(cfx.amp.fp8_meta_state(cfx.amp.fp8_slots(model), ...)).")
        return step

    def scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self._step().scale
        return s[self.base], s[self.base + 1], s[self.base + 2]

    def observe(self, i: int, t: torch.Tensor) -> None:
        self._step().observe(self.base + i, t)
