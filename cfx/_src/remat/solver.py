"""Optimal checkpointing schedules for a chain (Rotor), and Chen's sqrt(n) segmentation.

The dynamic program is the persistent one of Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova,
"Optimal checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory" (2019). It knows nothing of how a schedule is executed: it reads a :class:`Chain` of
costs and returns a :class:`Schedule`, a list of operations.

Operations (stage ``i`` maps ``a[i-1]`` to ``a[i]``; ``d[i]`` is the gradient of ``a[i]``):

- ``F_ck(i)``: run stage i without grad, keep its input ``a[i-1]``, store ``a[i]``.
- ``F_n(i)``: run stage i without grad, store ``a[i]`` and free ``a[i-1]``.
- ``F_all(i)``: run stage i with grad, store ``abar[i]`` (everything its backward needs, ``a[i]``
  included; the input ``a[i-1]`` stays where it is).
- ``B(i)``: backward of stage i: reads ``abar[i]``, ``a[i-1]`` and ``d[i]``, writes ``d[i-1]``,
  frees ``abar[i]`` and ``d[i]``. Backwards run in order ``B(n), B(n-1), ..., B(1)``.
- ``discard(j)``: free the plain activation ``a[j]`` (never the chain input ``a[0]``).

Schedules are *persistent* (the class over which the DP is optimal): an activation that F_ck or
F_all has read (and ``a[0]``) is a checkpoint and stays in memory until ``B(j+1)`` has read it, so
``F_n`` may only free an activation nothing has read yet, and ``discard(j)`` comes after
``B(j+1)``. Without this rule a schedule could free a checkpoint early and recompute it later,
which can be cheaper on heterogeneous chains but is outside Rotor's DP.

Memory model (what :func:`simulate` counts, and what the solver keeps under the budget). *Held*
memory is the sum of the sizes of everything stored: the chain input ``a[0]`` (always, ``x[0]``),
each plain ``a[j]`` (``x[j]``), each ``abar[j]`` (``xbar[j]``), and the current gradient ``d[j]``
(``x[j]``; ``d[n]`` only exists inside ``B(n)``). The peak of an operation is held memory before
it plus what it allocates: ``x[i]`` for ``F_ck``/``F_n``, ``xbar[i]`` for ``F_all``, and
``x[i-1] + bw_tmp[i]`` for ``B(i)`` (plus ``x[n]`` for ``B(n)``, which materialises the output
gradient); frees happen after the operation. A schedule's peak is the largest such value and the
solver guarantees it is <= the budget. Time is the sum of ``fw[i]`` over forward operations and
``bw[i]`` over backwards. Model parameters, their gradients and the forward's own temporaries are
not counted: the budget is for activations.

Discretisation: sizes are counted in slots. When all sizes share a common factor ``g`` with
``no_remat_peak / g <= max_slots`` (typical: activation bytes are multiples of a large power of
two) the slot is ``g`` and the solver is exact; otherwise sizes are rounded *up* to slots of
``ceil(no_remat_peak / max_slots)`` bytes and the budget down, so a schedule feasible in slots is
feasible in bytes (and may miss the byte-optimum by the rounding).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from cfx._src.remat.chain import Chain

F_CK, F_N, F_ALL, B, DISCARD = "F_ck", "F_n", "F_all", "B", "discard"
_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str   # one of F_ck, F_n, F_all, B, discard
    stage: int  # the stage index i (for discard: the activation index j)

    def __str__(self):
        return f"{self.kind}({self.stage})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A checkpointing schedule: ``ops`` executed in order, its ``time`` and ``peak`` memory."""

    chain: Chain
    ops: tuple
    time: float
    peak: int
    name: str = "rotor"
    budget: int | None = None

    def __iter__(self):
        return iter(self.ops)

    def __len__(self):
        return len(self.ops)

    def __str__(self):
        c = self.chain
        base = sum(c.fw) + sum(c.bw)
        budget = "" if self.budget is None else f", budget {self.budget}"
        head = (f"Schedule ({self.name}{budget}): "
                f"{c.n} stages, time {_num(self.time)} = {_num(base)} forward+backward + "
                f"{_num(self.time - base)} recomputed, peak memory {self.peak}")
        lines = [head, f"  {'step':>4}  {'op':<11}{'peak':>6}  held after"]
        for k, (op, peak, held) in enumerate(_run(c, self.ops)[2], 1):
            lines.append(f"  {k:>4}  {str(op):<11}{peak:>6}  {' '.join(held)}")
        return "\n".join(lines)


def simulate(chain: Chain, ops: Sequence) -> tuple:
    """Execute ``ops`` (a Schedule or a sequence of Op) symbolically; return ``(time, peak)``.

    Raises ValueError if an operation reads an activation that is not in memory, or if the
    schedule does not complete the backward with nothing but ``a[0]`` and ``d[0]`` left.
    """
    time, peak, _ = _run(chain, ops)
    return time, peak


def no_remat(chain: Chain) -> Schedule:
    """Plain forward with grad then backward: the fastest schedule, and the largest peak."""
    return _schedule(chain, _no_remat_ops(chain), "no-remat")


def chen(chain: Chain, *, segment: int | None = None) -> Schedule:
    """Chen et al. 2016: keep the input of every ``segment``-th stage (default ceil(sqrt(n))),
    then recompute each segment with grad, last segment first, and backpropagate through it."""
    n = chain.n
    k = segment if segment is not None else math.ceil(math.sqrt(n))
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"chen: segment must be a positive int, got {segment!r}.")
    starts = list(range(1, n + 1, k))               # first stage of each segment
    ops = [Op(F_CK if i in starts else F_N, i) for i in range(1, starts[-1])]
    for s, e in reversed(list(zip(starts, starts[1:] + [n + 1]))):
        ops += [Op(F_ALL, i) for i in range(s, e)] + [Op(B, i) for i in range(e - 1, s - 1, -1)]
        if s > 1:
            ops.append(Op(DISCARD, s - 1))
    return _schedule(chain, ops, f"chen, segment {k}")


def solve(chain: Chain, budget: int, *, max_slots: int = 20000) -> Schedule:
    """The fastest persistent schedule whose peak memory (see module docstring) is <= budget.

    Raises ValueError, stating the minimum, when no schedule fits in ``budget``.
    """
    plain = no_remat(chain)
    if plain.peak <= budget:  # nothing to recompute: the fastest schedule fits
        return dataclasses.replace(plain, name="rotor", budget=budget)
    slot, units = _discretise(chain, max_slots)
    b = min(int(budget // slot), _peak_units(units))
    table = _Table(units)
    if b < units.x[0] or table.opt(1, units.n, b - units.x[0])[0] == _INF:
        minimum = minimum_budget(chain, max_slots=max_slots)
        raise ValueError(f"remat.solve: budget {budget} bytes ({budget / 2**20:.2f} MiB) is below the "
                         f"minimum feasible budget {minimum} bytes ({minimum / 2**20:.2f} MiB) for this "
                         f"{chain.n}-stage chain (memory model in cfx/_src/remat/solver.py); raise the "
                         f"budget to at least {minimum}.")
    ops = table.ops(1, units.n, b - units.x[0])
    sched = _schedule(chain, ops, "rotor", budget=budget)
    assert sched.peak <= budget, (sched.peak, budget)
    return sched


def minimum_budget(chain: Chain, *, max_slots: int = 20000) -> int:
    """The smallest budget for which :func:`solve` finds a schedule."""
    slot, units = _discretise(chain, max_slots)
    table = _Table(units)
    lo, hi = units.x[0], _peak_units(units)      # hi is always feasible (no remat)
    while lo < hi:
        mid = (lo + hi) // 2
        if table.opt(1, units.n, mid - units.x[0])[0] < _INF:
            hi = mid
        else:
            lo = mid + 1
    return hi * slot


class _Table:
    """The persistent DP: opt(s, t, f) = fastest way to backpropagate stages s..t, starting with
    a[s-1] and d[t] held (d[n] not yet materialised) and f free memory, ending with d[s-1] held
    and everything created in between freed."""

    def __init__(self, c: Chain):
        self.c = c
        self.opt = functools.lru_cache(maxsize=None)(self._opt)

    def _g(self, t):  # size of the held gradient d[t] at the start of a subproblem ending at t
        return self.c.x[t] if t < self.c.n else 0

    def _bwx(self, i):  # what B(i) allocates on top of held memory
        c = self.c
        return c.x[i - 1] + c.bw_tmp[i] + (c.x[i] if i == c.n else 0)

    def _opt(self, s, t, f):
        c = self.c
        if f < 0:
            return _INF, None
        if s == t:
            ok = f - c.xbar[s] >= self._bwx(s)
            return (c.fw[s] + c.bw[s], ("all",)) if ok else (_INF, None)
        best = (_INF, None)
        # F_all(s), recurse on s+1..t with abar[s] held, then B(s).
        if f >= c.xbar[s] and f - c.xbar[s] + self._g(t) - c.x[s] >= self._bwx(s):
            cost = c.fw[s] + self.opt(s + 1, t, f - c.xbar[s])[0] + c.bw[s]
            if cost < best[0]:
                best = (cost, ("all",))
        # F_ck(s) F_n(s+1) .. F_n(j-1): checkpoint a[j-1], solve j..t, discard, solve s..j-1.
        fwd_peak, fwd_time = c.x[s], c.fw[s]
        for j in range(s + 1, t + 1):
            if j > s + 1:
                fwd_peak = max(fwd_peak, c.x[j - 2] + c.x[j - 1])
                fwd_time += c.fw[j - 1]
            if fwd_peak > f:
                break
            right = self.opt(j, t, f - c.x[j - 1])[0]
            if right == _INF:
                continue
            cost = fwd_time + right + self.opt(s, j - 1, f + self._g(t) - c.x[j - 1])[0]
            if cost < best[0]:
                best = (cost, ("ck", j))
        return best

    def ops(self, s, t, f):
        cost, choice = self.opt(s, t, f)
        assert cost < _INF
        c = self.c
        if choice[0] == "all":
            mid = self.ops(s + 1, t, f - c.xbar[s]) if s < t else []
            return [Op(F_ALL, s), *mid, Op(B, s)]
        j = choice[1]
        fwd = [Op(F_CK, s)] + [Op(F_N, i) for i in range(s + 1, j)]
        return [*fwd, *self.ops(j, t, f - c.x[j - 1]), Op(DISCARD, j - 1),
                *self.ops(s, j - 1, f + self._g(t) - c.x[j - 1])]


def _discretise(chain: Chain, max_slots: int) -> tuple:
    if not isinstance(max_slots, int) or max_slots < 1:
        raise ValueError(f"remat: max_slots must be a positive int, got {max_slots!r}.")
    peak = _run(chain, _no_remat_ops(chain))[1]
    common = math.gcd(*chain.x, *chain.xbar, *chain.bw_tmp)  # exact when sizes share a large factor
    slot = common if common and peak / common <= max_slots else max(1, math.ceil(peak / max_slots))
    up = lambda seq: tuple(-(-v // slot) for v in seq)  # noqa: E731
    return slot, Chain(fw=chain.fw, bw=chain.bw, x=up(chain.x), xbar=up(chain.xbar),
                       bw_tmp=up(chain.bw_tmp))


def _no_remat_ops(chain: Chain) -> list:
    n = chain.n
    return [Op(F_ALL, i) for i in range(1, n + 1)] + [Op(B, i) for i in range(n, 0, -1)]


def _peak_units(units: Chain) -> int:
    return _run(units, _no_remat_ops(units))[1]


def _schedule(chain, ops, name, budget=None) -> Schedule:
    time, peak, _ = _run(chain, ops)
    return Schedule(chain=chain, ops=tuple(ops), time=time, peak=peak, name=name, budget=budget)


def _run(chain: Chain, ops: Sequence) -> tuple:
    """Symbolic execution: (time, peak, trace of (op, peak during op, names held after))."""
    c, n = chain, chain.n
    state = {0: "ck"}      # activation index -> "a" (plain), "ck" (plain checkpoint), "abar"
    grad = None            # index of the held gradient d[grad], None before B(n)
    nxt = n                # the next backward to run
    time, peak, trace = 0, 0, []

    def held():
        return sum(c.xbar[j] if k == "abar" else c.x[j] for j, k in state.items()) + (
            c.x[grad] if grad is not None else 0)

    def fail(k, op, why):
        raise ValueError(f"remat schedule: step {k} {op}: {why}.")

    for k, op in enumerate(ops, 1):
        i = op.stage
        if op.kind in (F_CK, F_N, F_ALL):
            if not 1 <= i <= n:
                fail(k, op, f"no stage {i} in a {n}-stage chain")
            if i - 1 not in state:
                fail(k, op, f"its input a[{i - 1}] is not in memory")
            if i in state:
                fail(k, op, f"a[{i}] is already in memory")
            if op.kind == F_N and state[i - 1] != "a":
                fail(k, op, f"F_n frees its input, but a[{i - 1}] is "
                            f"{'part of abar' if state[i - 1] == 'abar' else 'a checkpoint'}"
                            f" needed until B({i}); use F_ck")
            now = held() + (c.xbar[i] if op.kind == F_ALL else c.x[i])
            state[i] = "abar" if op.kind == F_ALL else "a"
            if op.kind == F_N:
                del state[i - 1]
            elif state[i - 1] == "a":
                state[i - 1] = "ck"
            time += c.fw[i]
        elif op.kind == B:
            if i != nxt:
                fail(k, op, f"the next backward must be B({nxt})" if nxt else "backward is done")
            if state.get(i) != "abar":
                fail(k, op, f"abar[{i}] is not in memory (run F_all({i}) first)")
            if i - 1 not in state:
                fail(k, op, f"its input a[{i - 1}] is not in memory")
            now = held() + c.x[i - 1] + c.bw_tmp[i] + (c.x[n] if i == n else 0)
            del state[i]
            grad, nxt = i - 1, nxt - 1
            time += c.bw[i]
        elif op.kind == DISCARD:
            if i == 0 or state.get(i) not in ("a", "ck"):
                fail(k, op, f"a[{i}] is not a plain activation in memory"
                            + (" (the chain input is never discarded)" if i == 0 else ""))
            if nxt > i:
                fail(k, op, f"a[{i}] is still needed by B({i + 1}); a checkpoint persists until "
                            "its last use (the persistent schedules of the memory model)")
            now = held()
            del state[i]
        else:
            fail(k, op, f"unknown operation kind {op.kind!r}")
        peak = max(peak, now)
        trace.append((op, now, [("abar" if kind == "abar" else "a") + str(j)
                                for j, kind in sorted(state.items())]
                      + ([f"d{grad}"] if grad is not None else [])))
    if nxt != 0 or set(state) != {0}:
        left = sorted(j for j in state if j)
        raise ValueError(f"remat schedule: incomplete: "
                         + (f"B({nxt}) .. B(1) never ran" if nxt else
                            f"activations {left} are still in memory at the end"))
    return time, peak, trace


def _num(v):
    return f"{v:g}" if isinstance(v, float) else str(v)
