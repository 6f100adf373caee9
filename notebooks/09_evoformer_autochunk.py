# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Evoformer at length: AutoChunk and Dynamic Axial Parallelism
#
# AlphaFold 2's Evoformer carries two representations: the MSA `m` (S sequences x R residues) and
# the pair `z` (R x R). Its triangle attention builds logits of R x heads x R x R: activation
# memory grows with the *cube* of the length, which is what stops long proteins. Two remedies,
# both from FastFold:
#
# * **AutoChunk** (`cfx.autochunk`) traces the function, estimates each op's activation memory,
#   finds *regions* -- runs of ops none of which reduces along some dimension -- and computes them
#   chunk by chunk along it, choosing chunk sizes so the peak fits a budget;
# * **DAP** (`cfx.parallel.dap`) splits `m` by sequences and `z` by rows over an `axial` mesh axis,
#   switching axes with all-to-alls where the attended axis changes.
#
# This notebook plots peak activation memory against length with and without AutoChunk, checks
# that chunking changes no number, and shows DAP's per-rank memory.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P

cfg = cfx.models.EvoformerConfig(n_blocks=1, c_m=16, c_z=16, c_hidden_msa_att=8, n_heads_msa=2, c_hidden_opm=4,
                                 c_hidden_mul=16, c_hidden_pair_att=8, n_heads_pair=4)
model = cfx.models.Evoformer(cfg)
params = model.init(cfx.random.key(0))
S = 4


def inputs(R, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, R, cfg.c_m, generator=g), torch.randn(R, R, cfg.c_z, generator=g)


def peak(fn, *args):
    """Peak bytes of every op's fresh outputs while ``fn`` runs (inputs and params excluded)."""
    with cfx.memory.track() as mem, mem.track_ops(tier="host"), torch.no_grad():
        fn(*args)
    return mem.peak("host")


# %% [markdown]
# ## Memory against length
# The unchunked peak grows like R^3; under a fixed budget AutoChunk keeps the peak at the budget
# until the tensors that must stay whole (the pair representation itself, the operands every row
# of a triangle update needs) fill it.

# %%
budget = 6 << 20
lengths = [32, 48, 64, 96, 128]
plain, chunked = [], []
for R in lengths:
    m, z = inputs(R)
    plain.append(peak(model.apply, params, m, z))
    try:
        fn = cfx.autochunk(model.apply, (params, m, z), memory_budget=budget)
        chunked.append(peak(fn, params, m, z))
    except ValueError:  # no chunking reaches the budget at this length
        chunked.append(float("nan"))

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(lengths, [b / 2**20 for b in plain], "o-", label="unchunked")
ax.plot(lengths, [b / 2**20 for b in chunked], "s-", label="AutoChunk")
ax.axhline(budget / 2**20, color="gray", ls="--", label="budget")
ax.set_xlabel("residues R")
ax.set_ylabel("peak activations (MiB)")
ax.set_yscale("log")
ax.legend()
plt.show()
for R, a, b in zip(lengths, plain, chunked):
    print(f"R={R:4d}: unchunked {a / 2**20:7.2f} MiB, AutoChunk {b / 2**20:6.2f} MiB")

# %% [markdown]
# ## What AutoChunk chose, and that it changes no number
# Each region names the op it ends at, the dimension it chunks and how many chunks; the output is
# the unchunked function's.

# %%
m, z = inputs(96)
fn = cfx.autochunk(model.apply, (params, m, z), memory_budget=budget)
print(fn.report())
with torch.no_grad():
    want, got = model.apply(params, m, z), fn(params, m, z)
cfx.tree.assert_tree_close(got, want)
print("chunked == unchunked")

# %% [markdown]
# ## Dynamic Axial Parallelism
# On `{"axial": 4}` each rank holds a quarter of `m`'s sequences and of `z`'s rows; the output
# equals one device's, and the largest rank holds close to a quarter of the activations.

# %%
R = 64
m, z = inputs(R)
dap = cfx.parallel.dap(model, "axial")
single = peak(model.apply, params, m, z)
with cfx.Mesh({"axial": 4}) as mesh, cfx.memory.track(ops=True) as mem, cfx.comm_stats() as stats:
    f = cfx.shard_map(lambda p, m, z: dap.apply(p, m, z), mesh=mesh, in_specs=(P(), P("axial"), P("axial")),
                      out_specs=(P("axial"), P("axial")))
    with torch.no_grad():
        out = cfx.device_get(f(params, m, z))
    per_rank = max(mem.peak("device", rank=r) for r in range(4))
with torch.no_grad():
    cfx.tree.assert_tree_close(out, model.apply(params, m, z))
print(f"one device {single / 2**20:.2f} MiB, largest of 4 ranks {per_rank / 2**20:.2f} MiB "
      f"({per_rank * 4 / single:.2f} x 1/4)")
print({op: stats.count(op=op, rank=0) for op in ("all_to_all", "all_gather")}, "collectives per rank")
