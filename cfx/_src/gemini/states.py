"""Tensor states inside a chunk, and the table of legal moves between them.

A parameter packed in a chunk is in exactly one state:

- ``FREE``: its payload is not materialised here (the chunk holds only this rank's shard);
- ``HOLD``: materialised and idle (gathered, nobody using it);
- ``COMPUTE``: in use by the op that is running now;
- ``HOLD_AFTER_FWD``: used by the forward pass, waiting for the backward pass to use it again;
- ``HOLD_AFTER_BWD``: its gradient is produced, waiting to be reduced / applied.

The table below is the whole contract. Each legal move names the event that causes it. Two
rules carry most of the safety: nothing is computed on before it is gathered (``FREE`` only goes
to ``HOLD``), and a gradient is never thrown away before it is reduced (``HOLD_AFTER_BWD`` cannot
go to ``FREE``; it must be reduced to ``HOLD`` first). A tensor in ``COMPUTE`` cannot be released.
Staying in the same state is not a move and is rejected, so a double ``post_fwd`` shows up.

One training step of a parameter, every move legal::

    FREE -gather-> HOLD -pre_fwd-> COMPUTE -post_fwd-> HOLD_AFTER_FWD -release-> FREE
    -gather-> HOLD -pre_bwd-> COMPUTE -post_bwd-> HOLD_AFTER_BWD -reduce-> HOLD -release-> FREE
"""
from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping


class TensorState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


S = TensorState

# state -> {next state: the event that moves it there}
EVENTS: Mapping[TensorState, Mapping[TensorState, str]] = MappingProxyType({
    S.FREE: MappingProxyType({
        S.HOLD: "gather (payload materialised: all-gathered or loaded)",
    }),
    S.HOLD: MappingProxyType({
        S.COMPUTE: "pre_fwd / pre_bwd / pre_op (an op starts using it)",
        S.FREE: "release (drop the gathered payload, keep the shard)",
    }),
    S.COMPUTE: MappingProxyType({
        S.HOLD_AFTER_FWD: "post_fwd (forward op done, backward will use it again)",
        S.HOLD_AFTER_BWD: "post_bwd (backward op done, gradient produced)",
        S.HOLD: "post_op (an op with no backward to follow: eval forward, optimizer update)",
    }),
    S.HOLD_AFTER_FWD: MappingProxyType({
        S.COMPUTE: "pre_bwd, or pre_fwd again (a tied weight used twice in forward)",
        S.FREE: "release between forward and backward (re-gathered before backward)",
        S.HOLD: "end_step (the step ended without a backward pass)",
    }),
    S.HOLD_AFTER_BWD: MappingProxyType({
        S.COMPUTE: "pre_bwd again (a tied weight accumulating a second gradient)",
        S.HOLD: "reduce (gradient reduced / applied)",
    }),
})

# state -> the set of legal next states
TRANSITIONS: Mapping[TensorState, frozenset[TensorState]] = MappingProxyType(
    {s: frozenset(nxt) for s, nxt in EVENTS.items()})


class IllegalTransition(ValueError):
    """A tensor was asked to move between states the table does not connect."""


def is_legal(old: TensorState, new: TensorState) -> bool:
    return new in TRANSITIONS[old]


def transition(old: TensorState, new: TensorState, *, what: str) -> TensorState:
    """``new`` if ``old -> new`` is in the table; otherwise raise ``IllegalTransition``.

    ``what`` names the tensor (its path and chunk) in the error message.
    """
    if new in TRANSITIONS[old]:
        return new
    legal = ", ".join(f"{s.name} ({EVENTS[old][s]})" for s in sorted(TRANSITIONS[old], key=lambda s: s.name))
    hint = ""
    if old is S.FREE and new is S.COMPUTE:
        hint = " Gather the chunk (FREE -> HOLD) before computing on it."
    elif old is S.HOLD_AFTER_BWD and new is S.FREE:
        hint = " Reduce the gradient (HOLD_AFTER_BWD -> HOLD) before releasing the chunk."
    elif old is S.COMPUTE and new is S.FREE:
        hint = " Finish the op (post_fwd / post_bwd / post_op) before releasing."
    raise IllegalTransition(f"{what}: illegal state change {old.name} -> {new.name}; from {old.name} "
                            f"the legal next states are: {legal}.{hint}")
