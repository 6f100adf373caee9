"""The optimizer step of a ``GeminiEngine``: every chunk, slice by slice, where its state lives.

One all-reduce gives the whole model's sum of squares and non-finite count (from the gradients in
memory, or from what ``ChunkStores.flush_grad`` recorded as each file slice was written); each
slice is then stepped inside ``cfx.optim.sharded`` with the rest of them, so clipping and the loss
scaler see every chunk of every rank. From files, the next slice's params, gradient, master and
moments are read on the I/O thread while this one steps, and the stepped ones are written behind.
"""
from __future__ import annotations

import torch

from cfx._src.lax import collectives as lax
from cfx._src.optim import reduction

NO_LEAF_NORMS = ("cfx.zero.GeminiEngine steps flat chunks that pack many leaves; train with "
                 "cfx.parallel.Plan(zero=3, offload=...) instead, whose optimizer sees each leaf's pieces")


def update(engine) -> None:
    """One optimizer step over every chunk of ``engine`` (module doc); the gradients dropped."""
    units = [(c, s) for c in range(engine.chunks.n_chunks) for s in range(engine.tiers.n_slices)]
    with torch.no_grad():
        if engine.files:
            zero = torch.zeros(())
            norms = [engine._norms.get(u, (zero, zero)) for u in units]
            grads = None
        else:
            grads = [engine.tiers.take_grad(c) for c in range(engine.chunks.n_chunks)]
            norms = [(g.pow(2).sum(), (~torch.isfinite(g)).sum().to(torch.float32)) for g in grads]
        # one all-reduce for the whole model's norm and inf/nan count; each unit is stepped
        # inside cfx.optim.sharded with the rest of them, so clipping and the loss scaler
        # see every chunk of every rank
        sq, bad = [n[0] for n in norms], [n[1] for n in norms]
        total = lax.psum(torch.stack([sum(sq), sum(bad)]), engine.axis)
        ahead = read_unit(engine, *units[0]) if engine.files else None
        for k, (c, s) in enumerate(units):
            got = ahead
            if engine.files and k + 1 < len(units):
                ahead = read_unit(engine, *units[k + 1])  # the next slice read while this one steps
            with reduction.sharded([()], every=(), psum=lax.psum, rest_sq=(total[0] - sq[k]).clamp_min(0.0),
                                   rest_bad=total[1] - bad[k], no_leaf_norms=NO_LEAF_NORMS):
                update_unit(engine, c, s, got if engine.files else memory_unit(engine, c, grads[c]))
        engine._norms.clear()
        if engine.files:
            engine.tiers.io.drain()  # the step's state is in its files before the step returns


def read_unit(engine, c: int, s: int) -> dict:
    """Slice ``s`` of chunk ``c`` from the files: params, gradient (zeros where none arrived),
    master (low precision) and optimizer state, read on the I/O thread."""
    home, ohome = engine.cfg.param_home, engine.cfg.optim_home
    got = {"param": engine.tiers.read_async(home, ("param", c, s)), "inner": engine.tiers.inner_async(c, s)}
    if engine.tiers.has_file(("grad", c, s)):
        got["grad"] = engine.tiers.read_async("nvme", ("grad", c, s))
    if engine.dtype != torch.float32:
        got["master"] = engine.tiers.read_async(ohome, ("master", c, s))
    return got


def memory_unit(engine, c: int, grad: torch.Tensor) -> dict:
    home, ohome = engine.cfg.param_home, engine.cfg.optim_home
    got = {"param": engine.tiers.get(home, ("param", c, 0)), "inner": engine.tiers.inner_async(c, 0), "grad": grad}
    if engine.dtype != torch.float32:
        got["master"] = engine.tiers.get(ohome, ("master", c, 0))
    return got


def update_unit(engine, c: int, s: int, got: dict) -> None:
    home, ohome = engine.cfg.param_home, engine.cfg.optim_home
    p = engine.tiers.value(got["param"])
    a, b = engine.tiers.bounds(s)
    g = engine.tiers.value(got["grad"]) if "grad" in got else torch.zeros(b - a, dtype=torch.float32)
    if engine.files and "grad" in got:
        engine.tiers.discard_file(("grad", c, s))
    low = engine.dtype != torch.float32
    master = engine.tiers.value(got["master"]) if low else p
    (u,), inner = engine.tx.update((g,), engine.tiers.inner_of(got["inner"]), (master,))
    if low:
        new_master = master + u
        engine.tiers.write(ohome, ("master", c, s), new_master, "optim")
        new_p = new_master.to(engine.dtype)
    else:
        new_p = p + u
    engine.tiers.write(home, ("param", c, s), new_p, "param")
    engine.tiers.write_inner(c, s, inner)
