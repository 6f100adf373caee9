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
# # 2D, 2.5D and 3D tensor parallelism
#
# Megatron's tensor parallelism (1D) splits a block's weights over one mesh axis, but every rank
# still holds the whole activation `(B, T, C)` and all-reduces it with *every* other rank, twice
# each way per block. Colossal-AI's multi-dimensional schemes split activations *and* weights over
# a grid, and each collective runs inside one row, column or depth of it:
#
# * **2D** (Optimus, SUMMA) on a `q x q` grid: `y = all_gather(x, col) @ all_gather(w, row)`;
# * **2.5D** (Tesseract) on `q x q x d`: the 2D grid repeated over `d` ranks sharing the weights;
# * **3D** (Bian et al.) on a `q x q x q` cube: inputs and weights gathered, outputs reduce-scattered,
#   with two layouts that alternate between a block's Linears.
#
# In cfx each is one layer transform, `cfx.parallel.tensor_parallel_grid(model, mode=...)`, over named
# mesh axes (`row`, `col`, `dep`), written with `cfx.lax` collectives whose transposes give the backward.

# %%
# %matplotlib inline
import dataclasses

import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P
from cfx.bench.tensor_parallel import GRIDS, MEDIUM, formula_table, grid_label, measure

MESHES = {"2d": {"row": 2, "col": 2}, "2.5d": {"row": 2, "col": 2, "dep": 2}, "3d": {"row": 2, "col": 2, "dep": 2}}

# %% [markdown]
# ## Who holds what
# Each rank writes its own number into its block of an activation `(B, C)` (one position of `T`) and of
# a weight `(in, out)`; gathering the result shows the layout. In 2D every rank owns one of `q^2` tiles
# of both. In 3D the activation's batch is split over two axes and its features over the third, and
# a weight's `in` dim over two: every rank owns `1/q^3` of each; the block's second layout (`B`, where
# the attention runs) swaps the roles of `row` and `col`.

# %%
def owners(shape, spec, mesh):
    """The global array whose every element is the rank that holds it under ``spec``."""
    axes = tuple(mesh.shape)
    return cfx.device_get(cfx.shard_map(lambda x: torch.full_like(x, float(cfx.lax.axis_index(axes))), mesh=mesh,
                                        in_specs=spec, out_specs=spec)(torch.zeros(shape)))


B, C, F = 8, 16, 32
panels = []
for mode in ("2d", "3d"):
    grid = cfx.parallel.TensorGrid(mode)
    block = cfx.parallel.tensor_parallel_grid(cfx.nn.TransformerBlock(C, 4, F), mode)
    specs = cfx.parallel.grid_specs(block)
    with cfx.Mesh(MESHES[mode]) as mesh:
        drop_t = lambda s: P(s[0], s[2])  # the (B, T, C) spec without T
        panels += [(f"{mode}: activation (B, C), layout A", owners((B, C), drop_t(grid.a.spec()), mesh)),
                   (f"{mode}: attention's layout", owners((B, C), drop_t(grid.inner.spec()), mesh)),
                   (f"{mode}: mlp.fc weight (C, F)", owners((C, F), specs["mlp"]["fc"]["w"], mesh))]
fig, axes = plt.subplots(2, 3, figsize=(11, 6))
for ax, (title, own) in zip(axes.flat, panels):
    ax.imshow(own, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for r in own.unique().tolist():  # each rank's number at the middle of its block
        i, j = (own == r).nonzero().float().mean(0).tolist()
        ax.text(j, i, int(r), ha="center", va="center", fontsize=9)
    ax.set_title(title, fontsize=9)
fig.tight_layout()

# %% [markdown]
# ## The same numbers as one device
# A GPT-2 block (fp64) under each scheme: its output and its gradients against the unsplit block.

# %%
block = cfx.nn.TransformerBlock(C, 4, F)
params = cfx.tree.map(lambda t: t.double(), block.init(cfx.random.key(0)))
x = torch.randn(8, 5, C, dtype=torch.float64)
ref_y, ref_g = block.apply(params, x), cfx.grad(lambda p: block.apply(p, x).pow(2).sum())(params)
for mode, shape in MESHES.items():
    gb = cfx.parallel.tensor_parallel_grid(block, mode)
    specs = cfx.parallel.grid_specs(gb)
    with cfx.Mesh(shape) as mesh:
        y, g = cfx.device_get(cfx.shard_map(
            lambda p, x: (gb.apply(p, x), cfx.grad(lambda p: gb.apply(p, x).pow(2).sum())(p)),
            mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs))(params, x))
    err = max((y - ref_y).abs().max().item(), *[(a - b).abs().max().item() for a, b in
                                                zip(cfx.tree.leaves(g), cfx.tree.leaves(ref_g))])
    print(f"{mode:5s} {' x '.join(f'{a}={n}' for a, n in shape.items()):24s} largest difference {err:.1e}")
    assert err < 1e-10

# %% [markdown]
# ## Communication, measured against the formulas
# `cfx.comm_stats` counts every collective of one block's forward and backward (a middle block: input and
# output already in the grid's layout); each becomes the bytes a ring algorithm sends. The formulas
# (`python -m cfx.bench tensor_parallel` prints them) predict each rank's bytes, peers, params and
# activations exactly.

# %%
print(f"{'scheme':7s}{'mesh':28s}{'bytes sent':>12s}{'formula':>12s}{'peers':>7s}{'param B':>9s}{'input B':>9s}")
for scheme, shapes in GRIDS.items():
    shape = shapes[-1]
    m = measure(scheme, shape, C=32)
    where = " x ".join(f"{a}={n}" for a, n in shape.items())
    print(f"{scheme:7s}{where:28s}{m['wire']:12.0f}{m['f_wire']:12.0f}{m['peers']:7d}{m['params']:9d}{m['acts']:9d}")
    assert abs(m["wire"] / m["f_wire"] - 1) < 1e-9 and m["peers"] == m["f_peers"]

# %% [markdown]
# ## At 8, 64 and 1000 ranks
# From the formulas, for a GPT-2 medium block (`B=8, T=1024, C=1024`, fp32). Megatron's all-reduce makes
# each of 1000 ranks talk to the other 999 and send about `8 M C` bytes per block whatever `P`; the cube
# talks to 27 (9 in each collective) and sends a few percent of that, while holding 1/1000 of the
# activations. (1000 is no square, so 2D there is the formula at `q = sqrt(1000)`.)

# %%
rows = formula_table(MEDIUM, (8, 64, 1000))
print(f"{'P':>5s} {'scheme':6s}{'grid':>14s}{'peers':>8s}{'per coll.':>10s}{'MiB sent':>10s}{'param MiB':>10s}"
      f"{'act MiB':>9s}")
for r in rows:
    print(f"{r['P']:5d} {r['scheme']:6s}{grid_label(r):>14s}{r['peers']:8.4g}{r['group']:10.4g}"
          f"{r['comm'] / 2**20:10.1f}{r['params'] / 2**20:10.3f}{r['acts'] / 2**20:9.3f}")
one, cube = [r for r in rows if r["P"] == 1000 and r["scheme"] in ("1d", "3d")]
assert (one["peers"], cube["peers"], cube["group"]) == (999, 27, 9)

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
schemes = ("1d", "2d", "2.5d", "3d")
for ax, key, label in zip(axes, ("comm", "peers", "acts"),
                          ("MiB sent per rank per block", "ranks a rank talks to", "activation MiB per rank")):
    for s in schemes:
        pts = [(r["P"], r[key] / (2**20 if key != "peers" else 1)) for r in rows if r["scheme"] == s]
        ax.plot(*zip(*pts), marker="o", label=s)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_title(label, fontsize=10)
axes[0].legend()
fig.tight_layout()

# %% [markdown]
# ## Large batches: LAMB and LARS
# The other half of this story (`python -m cfx.bench large_batch`): scikit-learn's `load_digits`, an MLP, the
# same number of epochs at every batch size, so a batch 16x larger takes 16x fewer steps. Here a short run
# (12 epochs, one seed) of AdamW, LAMB and LARS with the papers' learning-rate scaling and warm-up; the bench's
# 150 epochs over three seeds put LAMB at batch 4096 1.3 points under batch 64 and LARS 0.7, while AdamW loses
# 1.5 and SGD diverges.

# %%
from cfx.bench import large_batch

data = large_batch.digits()
batches = (64, 256, 1024)
curves = {name: [large_batch.train(large_batch.RECIPES[name], b, epochs=12, seed=0, data=data)["accuracy"]
                 for b in batches] for name in ("adamw", "lamb", "lars")}
for name, accs in curves.items():
    print(f"{name:6s}", "  ".join(f"B={b}: {a:5.1f}%" for b, a in zip(batches, accs)))
    assert min(accs) > 30  # every recipe learns at every batch size (chance is 10%)

fig, ax = plt.subplots(figsize=(4.5, 3.2))
for name, accs in curves.items():
    ax.plot(batches, accs, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size (same epochs)")
ax.set_ylabel("test accuracy %")
ax.legend()
fig.tight_layout()
