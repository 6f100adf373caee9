"""Pipeline schedules as data: per-rank lists of actions, built here, checked in ``validate.py``.

The model is cut into ``n_stages = p * v`` *virtual stages* ``0..p*v-1`` run in sequence; ``p``
ranks hold ``v`` stages each (``v`` chunks; 1 unless interleaved). Stage ``s`` lives on rank
``s % p`` (Megatron's interleaved layout: rank r holds stages r, r+p, r+2p, ...), so with v = 1
stage s is rank s. The batch is split into ``m`` microbatches; per (stage, microbatch):

  F  forward. Needs the stage input: the output of F of stage s-1 (the batch itself for s = 0).
     The last stage's F includes the loss.
  B  full backward (input gradient + weight gradient). Needs F of the same (stage, microbatch)
     and, for s < last, the gradient of the stage output: what B or I of stage s+1 produces.
  I  input-gradient half of B (zero-bubble split); same needs as B, produces what B produces.
  W  weight-gradient half of B. Needs I of the same (stage, microbatch); nothing needs W.

Data crosses ranks through explicit messages, labelled by the stage that *produced* the data:

  SEND_F s  on rank(s)   to   peer rank(s+1): output of F of stage s           (s < last)
  RECV_F s  on rank(s+1) from peer rank(s)
  SEND_B s  on rank(s)   to   peer rank(s-1): input gradient from B/I of s     (s > 0)
  RECV_B s  on rank(s-1) from peer rank(s)

When two consecutive stages share a rank (only when p == 1) the handoff is local: no message.
SEND is buffered (never blocks); RECV blocks until its SEND was issued.
"""
from __future__ import annotations

import dataclasses

COMPUTE = ("F", "B", "I", "W")
MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + MESSAGES


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: compute (F/B/I/W) or a message (SEND_*/RECV_*, with ``peer``)."""

    kind: str
    microbatch: int
    stage: int            # global virtual stage, 0..p*v-1; for messages the producing stage
    peer: int | None = None  # the rank on the other side of a SEND/RECV; None for compute

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind must be one of {KINDS}, got {self.kind!r}.")
        for name in ("microbatch", "stage") + (("peer",) if self.peer is not None else ()):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"Action {self.kind}: {name} must be an integer >= 0, got "
                                 f"{val!r}.")
        if (self.kind in MESSAGES) != (self.peer is not None):
            raise ValueError(f"Action {self.kind}: give peer= (the other rank) for SEND/RECV "
                             f"and only for them, got peer={self.peer!r}.")

    def __str__(self) -> str:
        s = f"{self.kind}{self.microbatch}s{self.stage}"
        if self.kind.startswith("SEND"):
            return f"{s}->{self.peer}"
        return f"{s}<-{self.peer}" if self.kind.startswith("RECV") else s


def in_flight_delta(action: Action, *, release: str = "I") -> int:
    """Change in the count of activations alive on the acting rank: +1 at F, -1 when freed.

    A (stage, microbatch) activation is alive from its F until its B, or, for a split backward,
    until ``release`` ("I", the default: after I only the weight-gradient inputs remain; or "W",
    the stricter count: W still reads the stored layer inputs). Each chunk of an interleaved
    rank counts separately. The validator's ``max_in_flight`` uses the default.
    """
    if release not in ("I", "W"):
        raise ValueError(f"release must be 'I' or 'W' (the half that frees the activation), "
                         f"got {release!r}.")
    if action.kind == "F":
        return 1
    return -1 if action.kind in ("B", release) else 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[r]`` is what rank r does, in execution order."""

    name: str
    n_ranks: int          # p
    n_microbatches: int   # m
    n_chunks: int         # v, virtual stages per rank
    actions: tuple[tuple[Action, ...], ...]  # (p,) per-rank action lists

    def __post_init__(self):
        _check_args(f"Schedule {self.name!r}", p=self.n_ranks, m=self.n_microbatches,
                    v=self.n_chunks)
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
        if len(self.actions) != self.n_ranks:
            raise ValueError(f"Schedule {self.name!r}: give one action list per rank, got "
                             f"{len(self.actions)} lists for n_ranks={self.n_ranks}.")

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.n_chunks

    def stage_rank(self, stage: int) -> int:
        """The rank holding virtual stage ``stage``."""
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages held by ``rank``, chunk 0 first."""
        return [rank + c * self.n_ranks for c in range(self.n_chunks)]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def peak_in_flight(self, rank: int, *, release: str = "I") -> int:
        """Most activations alive at once on ``rank`` (see ``in_flight_delta``)."""
        alive = peak = 0
        for a in self.actions[rank]:
            alive += in_flight_delta(a, release=release)
            peak = max(peak, alive)
        return peak


def _check_args(fn: str, **sizes: int) -> None:
    names = {"p": "n_ranks p", "m": "n_microbatches m", "v": "n_chunks v"}
    for key, val in sizes.items():
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{fn}: {names[key]} must be an integer >= 1, got {val!r}; "
                             f"pass a positive integer.")


def check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    """ValueError where schedule ``name`` (a generator's name) refuses ``p`` ranks, ``m`` microbatches and
    ``v`` chunks, without building it (a 64-rank, 512-microbatch schedule has 200,000 actions)."""
    _check_args(name, p=p, m=m, v=v)
    if name == "interleaved_1f1b" and m % p:
        fits = " or ".join(f"m={k * p}" for k in sorted({max(m // p, 1), m // p + 1}))
        raise ValueError(f"interleaved_1f1b: n_microbatches m={m} must be a multiple of n_ranks "
                         f"p={p} (microbatches run in groups of p); use {fits}.")


def _made(kind: str, microbatch: int, stage: int, peer: int | None) -> Action:
    """An ``Action`` a generator here made from non-negative ints and a kind of ``KINDS``: the fields
    set without ``Action``'s per-field checks (a 64-rank schedule has ~10^5 of them; ``validate``
    still checks every schedule as a whole)."""
    a = object.__new__(Action)
    _set(a, "kind", kind)
    _set(a, "microbatch", microbatch)
    _set(a, "stage", stage)
    _set(a, "peer", peer)
    return a


_set = object.__setattr__


def _with_messages(name: str, p: int, m: int, v: int, orders: list[list[tuple]]) -> Schedule:
    """Turns per-rank compute orders [(kind, microbatch, stage), ...] into a Schedule, inserting
    RECV right before the compute that needs the data and SEND right after the one producing it."""
    last = p * v - 1

    def rank(stage: int) -> int:  # same layout as Schedule.stage_rank
        return stage % p

    out = []
    for r, order in enumerate(orders):
        acts = []
        for kind, mb, s in order:
            assert rank(s) == r, (name, kind, mb, s, r)
            if kind == "F" and s > 0 and rank(s - 1) != r:
                acts.append(_made("RECV_F", mb, s - 1, rank(s - 1)))
            if kind in ("B", "I") and s < last and rank(s + 1) != r:
                acts.append(_made("RECV_B", mb, s + 1, rank(s + 1)))
            acts.append(_made(kind, mb, s, None))
            if kind == "F" and s < last and rank(s + 1) != r:
                acts.append(_made("SEND_F", mb, s, rank(s + 1)))
            if kind in ("B", "I") and s > 0 and rank(s - 1) != r:
                acts.append(_made("SEND_B", mb, s, rank(s - 1)))
        out.append(tuple(acts))
    return Schedule(name, p, m, v, tuple(out))


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards in reverse microbatch order.

    With F = B = 1 the bubble fraction is (p-1)/(m+p-1); rank r holds all m activations at once.
    """
    _check_args("gpipe", p=p, m=m)
    orders = [[("F", mb, r) for mb in range(m)] + [("B", mb, r) for mb in reversed(range(m))]
              for r in range(p)]
    return _with_messages("gpipe", p, m, 1, orders)


def _one_f_one_b_order(p: int, m: int, r: int, *, w_delay: int | None = None) -> list[tuple]:
    """Rank r's 1F1B compute order: min(p-r-1, m) warm-up forwards, then one forward and one
    backward per step, then the remaining backwards. With ``w_delay = d`` each backward is split:
    I(j) is followed by W(j-d), and the last d W's run after the final I."""
    warm = min(p - r - 1, m)
    order = [("F", mb, r) for mb in range(warm)]
    for j in range(m):
        if warm + j < m:
            order.append(("F", warm + j, r))
        if w_delay is None:
            order.append(("B", j, r))
            continue
        order.append(("I", j, r))
        if j - w_delay >= 0:
            order.append(("W", j - w_delay, r))
    if w_delay is not None:
        order += [("W", j, r) for j in range(max(m - w_delay, 0), m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward with one backward,
    then drains the remaining backwards. Same bubble as GPipe ((p-1)/(m+p-1) with F = B = 1) but
    rank r holds at most min(p-r, m) activations: p on rank 0.
    """
    _check_args("one_f_one_b", p=p, m=m)
    return _with_messages("1f1b", p, m, 1, [_one_f_one_b_order(p, m, r) for r in range(p)])


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): rank r holds v chunks (stages
    r, r+p, ..., r+(v-1)p) and runs microbatches in groups of p through one chunk after another.

    Rank r's k-th forward (k = 0..m*v-1) is microbatch (k // (p*v)) * p + k % p on chunk
    (k // p) % v; its k-th backward is the same microbatch on chunk v-1 - (k // p) % v. Rank r
    warms up with min(m*v, 2*(p-r-1) + (v-1)*p) forwards, then alternates one forward and one
    backward, then drains the backwards. With v = 1 this is exactly ``one_f_one_b`` (its
    warm-up p-r-1). Rank 0 holds up to min(m*v, (v+1)*p - 1) chunk activations (v = 1: min(m, p)).

    Costs per chunk (F = B = 1 for a 1/v slice of a stage): idle / compute == (p-1) / (v*m),
    the textbook bubble (p-1)/m shrunk v times. Requires m % p == 0.
    """
    check_sizes("interleaved_1f1b", p, m, v)
    if v == 1:
        return _with_messages("interleaved_1f1b", p, m, 1,
                              [_one_f_one_b_order(p, m, r) for r in range(p)])

    def step(kind: str, r: int, k: int) -> tuple[str, int, int]:  # (kind, microbatch, stage)
        chunk = (k // p) % v
        chunk = v - 1 - chunk if kind == "B" else chunk
        return kind, (k // (p * v)) * p + k % p, r + chunk * p

    orders = []
    for r in range(p):
        total = m * v
        warm = min(total, 2 * (p - r - 1) + (v - 1) * p)
        fwd = [step("F", r, k) for k in range(total)]
        bwd = [step("B", r, k) for k in range(total)]
        order = fwd[:warm]
        for k in range(total - warm):
            order += [fwd[warm + k], bwd[k]]
        orders.append(order + bwd[total - warm:])
    return _with_messages("interleaved_1f1b", p, m, v, orders)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023), handcrafted schedule 1.

    The backward is split into I (input gradient, on the critical path between ranks) and W
    (weight gradient, needed by nobody). F and I keep 1F1B's order and warm-up (min(p-r-1, m)
    forwards on rank r); rank r defers its W's by r: I(j) is followed by W(j-r), and the r W's
    left after the final I fill the tail, where 1F1B would wait for gradients. Activations
    alive on rank r, counted until I or even until W (``release="W"``), never exceed min(p, m),
    the 1F1B peak.

    With F = I = W = 1 and m >= p the makespan is 3m + p - 1: idle per rank p - 1, i.e. the
    paper's (p-1)(T_F + T_I - T_W), against 3(p-1) = (p-1)(T_F + T_B) for 1F1B with B = I + W:
    exactly a third of 1F1B's idle time (relative bubble (p-1)/(3m) against (p-1)/m). With
    m < p too few W's remain to fill the tail: for p = 4, m = 1, 2, 3 the idle ratio to 1F1B is
    2/3, 5/9, 4/9.
    """
    _check_args("zb_h1", p=p, m=m)
    return _with_messages("zb_h1", p, m, 1,
                          [_one_f_one_b_order(p, m, r, w_delay=r) for r in range(p)])
