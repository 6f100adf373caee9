"""Run a chain of stages under a checkpointing :class:`Schedule`, inside autograd.

The whole chain is one ``torch.autograd.Function``. Its forward executes the schedule's operations
up to the first backward (``F_ck`` / ``F_n`` without grad, ``F_all`` with grad on detached inputs,
so each stage's graph is its own); its backward executes the rest: the recomputations the schedule
asks for and each ``B(i)`` as ``torch.autograd.grad`` of stage i's output, which yields the
gradient of its input ``d[i-1]`` and of its parameters. Randomness is explicit (stages take keys),
so every recomputation replays the forward exactly; a collective inside a stage is re-issued by
every rank at the same operation, since all ranks run the same schedule. A stage's params may hold
ZeRO-3 ``ShardedLeaf``s: their pieces are the chain's inputs, and every (re)computation of the
stage gathers them again through its gathered layer.

While it runs, the executor measures the activation memory the schedule holds — the distinct
storages of plain activations ``a[j]``, of every tensor autograd saved for ``B(j)``, and of the
gradients ``d[j]`` — after each operation, before its frees (the moment the solver's memory model
counts as the operation's peak). The peak goes to active ``cfx.activation_stats()`` collectors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from cfx._src.core import tree as tree_util
from cfx._src.remat import engine
from cfx._src.remat.saved import SavedTensors, storage_keys
from cfx._src.remat.solver import B, DISCARD, F_ALL, F_CK, F_N, Schedule
from cfx._src.zero.params import is_sharded_leaf


class _Saved:
    """What ``F_all(i)`` keeps: its detached input, parameters, output and saved storages."""

    __slots__ = ("a_in", "params", "out", "storages")

    def __init__(self, a_in, params, out, storages):
        self.a_in, self.params, self.out, self.storages = a_in, params, out, storages


class _Execution:
    """One run of the schedule: the state that lives from the forward into the backward."""

    def __init__(self, fns, kwargs, treedefs, wraps, schedule: Schedule):
        self.fns, self.kwargs, self.treedefs, self.schedule = fns, kwargs, treedefs, schedule
        self.wraps = wraps  # per stage, per leaf: the ShardedLeaf its tensor is the piece of, or None
        self.a: dict[int, torch.Tensor] = {}      # plain activations a[j]
        self.abar: dict[int, _Saved] = {}         # stage graphs kept for B(j)
        self.d: dict[int, torch.Tensor] = {}      # gradient d[j] of a[j]
        self.pos = 0
        self.peak = 0

    # -- memory measurement -----------------------------------------------------------------
    def _held_bytes(self) -> int:
        seen: dict[int, int] = {}
        def add(t):
            st = t.untyped_storage()
            seen.setdefault(id(st), st.nbytes())
        for t in self.a.values():
            add(t)
        for s in self.abar.values():
            add(s.out)
            for st in s.storages:
                seen.setdefault(id(st), st.nbytes())
        for t in self.d.values():
            add(t)
        return sum(seen.values())

    def _measure(self) -> None:
        self.peak = max(self.peak, self._held_bytes())

    # -- operations ---------------------------------------------------------------------------
    def _input(self, i: int) -> torch.Tensor:
        if i - 1 in self.a:
            return self.a[i - 1]
        return self.abar[i - 1].out  # a[i-1] lives as the output of F_all(i-1)

    def _stage_params(self, i: int):
        leaves = [t if w is None else dataclasses.replace(w, piece=t) for t, w in zip(self.params[i - 1], self.wraps[i - 1])]
        return tree_util.unflatten(self.treedefs[i - 1], leaves)

    def _forward(self, op) -> None:
        i = op.stage
        x = self._input(i)
        if op.kind in (F_CK, F_N):
            with torch.no_grad():
                self.a[i] = self.fns[i - 1](self._stage_params(i), x, **self.kwargs[i - 1])
            self._measure()
            if op.kind == F_N and i - 1 > 0:
                self.a.pop(i - 1, None)
            return
        a_in = x.detach().requires_grad_(x.is_floating_point())
        with torch.enable_grad(), SavedTensors(storage_keys([a_in, *self.params[i - 1]])) as saved:
            out = self.fns[i - 1](self._stage_params(i), a_in, **self.kwargs[i - 1])
        self.abar[i] = _Saved(a_in, self.params[i - 1], out, [st for st, _ in saved.storages.values()])
        self._measure()

    def _backward(self, op) -> None:
        i = op.stage
        saved = self.abar[i]
        d = self.d[i]
        wrt = [saved.a_in] if i > 1 or self.x_requires_grad else []
        wrt += [p for p in saved.params if p.requires_grad]
        grads = torch.autograd.grad(saved.out, wrt, d, allow_unused=True) if wrt else []
        grads = list(grads)
        if i > 1 or self.x_requires_grad:
            g_in = grads.pop(0)
            self.d[i - 1] = g_in if g_in is not None else torch.zeros_like(saved.a_in)
        for p, g in zip([p for p in saved.params if p.requires_grad], grads):
            if g is not None:
                acc = self.grads.get(id(p))
                self.grads[id(p)] = g if acc is None else acc + g
        self._measure()
        del self.abar[i]
        self.d.pop(i, None)

    def run(self, upto_backward: bool, d_out: torch.Tensor | None = None) -> None:
        ops = self.schedule.ops
        while self.pos < len(ops):
            op = ops[self.pos]
            if op.kind == B:
                if upto_backward:
                    return
                if op.stage == len(self.fns):
                    self.d[op.stage] = d_out  # the output gradient, held until B(n) is done
                self._backward(op)
            elif op.kind == DISCARD:
                self.a.pop(op.stage, None)
            else:
                self._forward(op)
            self.pos += 1


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Execution, x, *flat_params):
        run.x_requires_grad = x.requires_grad
        run.params = []
        k = 0
        for td in run.treedefs:
            n = td.num_leaves
            run.params.append([p.detach().requires_grad_(p.requires_grad) for p in flat_params[k:k + n]])
            k += n
        run.a[0] = x.detach()
        run.run(upto_backward=True)
        ctx.run = run
        n = len(run.fns)
        return run.abar[n].out.detach()

    @staticmethod
    def backward(ctx, d_out):
        if ctx.run is None:  # again, for other inputs (a pipeline's W after its I): the same grads
            return ctx.grads
        run: _Execution = ctx.run
        run.grads = {}
        run.run(upto_backward=False, d_out=d_out)
        _report(run)
        d_x = run.d.pop(0, None) if run.x_requires_grad else None
        flat = [run.grads.get(id(p)) for ps in run.params for p in ps]
        ctx.run = None
        ctx.grads = (None, d_x, *flat)
        return ctx.grads


def _report(run: _Execution) -> None:
    for c in engine._collectors.active():
        c.chain_peaks.append((run.schedule.name, run.peak))


def run_chain(fns: Sequence[Callable], params: Sequence[Any], x: torch.Tensor, kwargs: Sequence[dict],
              schedule: Schedule) -> torch.Tensor:
    """``fns[n-1](params[n-1], ... fns[0](params[0], x) ...)`` under ``schedule`` when grad is on."""
    n = len(fns)
    if schedule.chain.n != n:
        raise ValueError(f"remat: the plan was solved for a chain of {schedule.chain.n} stages but is "
                         f"run on {n}; solve again for this model.")
    if not torch.is_grad_enabled():
        for fn, p, kw in zip(fns, params, kwargs):
            x = fn(p, x, **kw)
        return x
    flat, treedefs, wraps = [], [], []
    for p in params:
        leaves, td = tree_util.flatten(p, is_leaf=is_sharded_leaf)
        if not all(isinstance(t, torch.Tensor) or is_sharded_leaf(t) for t in leaves):
            raise ValueError("remat: every leaf of a chain stage's params must be a tensor (or a ZeRO-3 piece).")
        flat += [t.piece if is_sharded_leaf(t) else t for t in leaves]
        wraps.append([t if is_sharded_leaf(t) else None for t in leaves])
        treedefs.append(td)
    run = _Execution(list(fns), list(kwargs), treedefs, wraps, schedule)
    return _ChainFunction.apply(run, x, *flat)
