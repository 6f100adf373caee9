"""``validate``: proves a schedule runs to completion and computes every (stage, microbatch) once.

Three passes, each raising ``ScheduleError`` that names the rank, the step (index into that
rank's list) and the action:

1. placement: indices in range; a compute action on the rank holding its stage; a message on the
   rank its ``schedule.py`` route says, with the right peer; no duplicates; B never mixed with I/W.
2. execution: every rank runs its list in order; SEND is buffered, RECV blocks until the matching
   SEND (same family F/B, microbatch and producing stage, from that peer) was issued. A compute
   action or SEND whose inputs are not on its rank yet is an error on the spot (waiting cannot
   help: only this rank's earlier steps can provide them). When no rank can move, every stuck
   rank is reported (deadlock). ``max_in_flight`` bounds the activations alive on each rank
   (``schedule.in_flight_delta``: +1 at F, -1 at B or I, chunks counted separately).
   Every SEND must have its RECV and vice versa (checked before running).
3. completeness: every (stage, microbatch) has F and B, or F, I and W.
"""
from __future__ import annotations

from cfx._src.pipeline.schedule import Action, Schedule, in_flight_delta

# message kind -> (stage offset of the rank that holds it, stage offset of its peer)
_ROUTE = {"SEND_F": (0, 1), "RECV_F": (1, 0), "SEND_B": (0, -1), "RECV_B": (-1, 0)}


class ScheduleError(ValueError):
    """A schedule that would deadlock, use data before it exists, or leave work undone."""


def _fail(sched: Schedule, r: int, i: int, what: str) -> ScheduleError:
    acts = sched.actions[r]
    here = f"({acts[i]})" if i < len(acts) else "(end of list)"
    return ScheduleError(f"schedule {sched.name!r}: rank {r}, step {i} {here}: {what}")


def validate(schedule: Schedule, *, max_in_flight: int | None = None) -> None:
    """Raises ``ScheduleError`` unless ``schedule`` is complete and runs without deadlock."""
    if max_in_flight is not None and (isinstance(max_in_flight, bool)
                                      or not isinstance(max_in_flight, int) or max_in_flight < 1):
        raise ValueError(f"validate: max_in_flight must be None or an integer >= 1, got "
                         f"{max_in_flight!r}.")
    _check_placement(schedule)
    _check_pairs(schedule)
    _execute(schedule, max_in_flight)
    _check_complete(schedule)


def _check_placement(sched: Schedule) -> None:
    m, n = sched.n_microbatches, sched.n_stages
    seen: dict[tuple, tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, step)
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise _fail(sched, r, i, f"expected an Action, got {type(a).__name__}.")
            if not 0 <= a.microbatch < m:
                raise _fail(sched, r, i, f"microbatch must be in 0..{m - 1} (m={m}).")
            if not 0 <= a.stage < n:
                raise _fail(sched, r, i, f"stage must be in 0..{n - 1} (p*v={n}).")
            if a.kind in _ROUTE:
                home_off, peer_off = _ROUTE[a.kind]
                if not 0 <= a.stage + home_off + peer_off < n:  # the neighbouring stage
                    raise _fail(sched, r, i, f"stage {a.stage} has no neighbour to exchange "
                                f"this with; remove the message.")
                home = sched.stage_rank(a.stage + home_off)
                peer = sched.stage_rank(a.stage + peer_off)
            else:
                home, peer = sched.stage_rank(a.stage), None
            if home != r:
                raise _fail(sched, r, i, f"belongs on rank {home}, which holds that stage; "
                            f"move it there.")
            if peer is not None and a.peer != peer:
                raise _fail(sched, r, i, f"peer must be rank {peer}, the rank of the "
                            f"neighbouring stage, not {a.peer}.")
            if peer == r:
                raise _fail(sched, r, i, "both stages are on this rank; the handoff is local, "
                            "remove the message.")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise _fail(sched, r, i, f"duplicate of step {seen[key][1]}; remove one.")
            seen[key] = (r, i)
            clash = {"B": ("I", "W"), "I": ("B",), "W": ("B",)}.get(a.kind, ())
            for other in clash:
                if (other, a.stage, a.microbatch) in seen:
                    raise _fail(sched, r, i, f"{other} of the same (stage, microbatch) is at step "
                                f"{seen[other, a.stage, a.microbatch][1]}; use either B or I+W.")


def _execute(sched: Schedule, max_in_flight: int | None) -> None:
    p, last = sched.n_ranks, sched.n_stages - 1
    rank = sched.stage_rank
    done: set[tuple] = set()       # (kind, stage, mb) computed
    inputs: set[tuple] = set()     # (stage, mb) whose F input is on rank(stage)
    grads: set[tuple] = set()      # (stage, mb) whose output gradient is on rank(stage)
    sent: set[tuple] = set()       # (family "F"/"B", producing stage, mb) issued
    pos, alive = [0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            acts = sched.actions[r]
            while pos[r] < len(acts):
                i, a = pos[r], acts[pos[r]]
                s, mb = a.stage, a.microbatch
                if a.kind.startswith("RECV"):
                    if (a.kind[-1], s, mb) not in sent:
                        break  # blocked; another rank may unblock it
                    if a.kind == "RECV_F":
                        inputs.add((s + 1, mb))  # the consumer of stage s's output
                    else:
                        grads.add((s - 1, mb))   # the consumer of stage s's input gradient
                elif a.kind.startswith("SEND"):
                    made = ("F",) if a.kind == "SEND_F" else ("B", "I")
                    if not any((k, s, mb) in done for k in made):
                        raise _fail(sched, r, i, f"sends the output of {'/'.join(made)} of stage "
                                    f"{s}, microbatch {mb}, not computed yet on this rank.")
                    sent.add((a.kind[-1], s, mb))
                else:
                    _check_inputs(sched, r, i, a, done, inputs, grads)
                    done.add((a.kind, s, mb))
                    if a.kind == "F" and s < last and rank(s + 1) == r:
                        inputs.add((s + 1, mb))
                    if a.kind in ("B", "I") and s > 0 and rank(s - 1) == r:
                        grads.add((s - 1, mb))
                    alive[r] += in_flight_delta(a)
                    if max_in_flight is not None and alive[r] > max_in_flight:
                        raise _fail(sched, r, i, f"{alive[r]} activations alive on this rank, "
                                    f"more than max_in_flight={max_in_flight}; run a backward "
                                    f"earlier or raise the limit.")
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(sched.actions[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = sched.actions[r][pos[r]]
            lines.append(f"rank {r}, step {pos[r]} ({a}): waits for SEND_{a.kind[-1]}"
                         f"{a.microbatch}s{a.stage} from rank {a.peer}, "
                         + _where_sent(sched, a))
        raise ScheduleError(f"schedule {sched.name!r}: deadlock, no rank can proceed:\n  "
                            + "\n  ".join(lines))


def _where_sent(sched: Schedule, recv: Action) -> str:
    for i, a in enumerate(sched.actions[recv.peer]):
        if a.kind == "SEND" + recv.kind[4:] and (a.stage, a.microbatch) == (recv.stage,
                                                                           recv.microbatch):
            return f"which that rank issues only at its step {i}."
    raise AssertionError(f"_check_pairs lets no RECV without its SEND through: {recv}")


def _check_inputs(sched, r, i, a, done, inputs, grads) -> None:
    s, mb, last = a.stage, a.microbatch, sched.n_stages - 1
    if a.kind == "F":
        if s > 0 and (s, mb) not in inputs:
            raise _fail(sched, r, i, f"needs the output of F{mb}s{s - 1}, not on this rank yet; "
                        f"receive it (or compute it here) first.")
        return
    if a.kind == "W":
        if ("I", s, mb) not in done:
            raise _fail(sched, r, i, f"needs I{mb}s{s} earlier on this rank.")
        return
    if ("F", s, mb) not in done:  # B or I
        raise _fail(sched, r, i, f"needs F{mb}s{s} earlier on this rank.")
    if s < last and (s, mb) not in grads:
        raise _fail(sched, r, i, f"needs the input gradient of stage {s + 1}, microbatch {mb}, "
                    f"not on this rank yet; receive it (or compute it here) first.")


def _check_pairs(sched: Schedule) -> None:
    """Every SEND has its RECV and every RECV its SEND (placement already checked)."""
    msgs = {}  # (kind, stage, mb) -> (rank, step)
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if a.kind in _ROUTE:
                msgs[a.kind, a.stage, a.microbatch] = (r, i)
    for (kind, s, mb), (r, i) in msgs.items():
        other = ("RECV" if kind.startswith("SEND") else "SEND") + kind[4:]
        if (other, s, mb) not in msgs:
            a = sched.actions[r][i]
            arrow = "<-" if other.startswith("RECV") else "->"
            raise _fail(sched, r, i, f"rank {a.peer} has no matching {other}; add "
                        f"{other}{mb}s{s}{arrow}{r} to its list or remove this one.")


def _check_complete(sched: Schedule) -> None:
    have = {(a.kind, a.stage, a.microbatch) for acts in sched.actions for a in acts}
    for s in range(sched.n_stages):
        r = sched.stage_rank(s)
        for mb in range(sched.n_microbatches):
            need = ["F"] + (["I", "W"] if ("I", s, mb) in have or ("W", s, mb) in have else ["B"])
            for kind in need:
                if (kind, s, mb) not in have:
                    raise _fail(sched, r, len(sched.actions[r]),
                                f"{kind}{mb}s{s} never runs; add it to rank {r}'s list.")
