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
# # Auto-parallelism: from a one-device step to the fastest plan that fits
#
# `cfx.autoshard(step, mesh, example_args)` takes a plain `step(params, *batch) -> loss` and
#
# 1. **traces** its forward and backward into one graph of aten ops on fake tensors (nothing runs),
#    each op with its FLOPs and bytes;
# 2. lists each op's **strategies** over the mesh: a matmul can split its rows, its columns or its
#    contraction (partial sums) over each axis; attention its batch and heads; an embedding its
#    vocabulary or width; elementwise ops follow their inputs;
# 3. **prices** them: FLOPs over the split, bytes written over memory bandwidth, and between a
#    producer's layout and a consumer's the cheapest collectives `cfx.reshard` finds (alpha-beta per
#    axis), plus each rank's bytes (params with gradients and AdamW moments, saved activations);
# 4. **solves** an integer program (Alpa's intra-operator pass) for the cheapest assignment within a
#    memory budget;
# 5. **runs** it: every rank walks the traced graph on its own blocks, moving values between layouts
#    where the plan says.
#
# This notebook searches GPT-2 on a 2x2 mesh, watches the plan change with the batch and the
# budget, and checks that the plan it runs computes exactly what one device computes.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx._src.autoshard.graph import trace
from cfx._src.autoshard.search import search
from cfx._src.autoshard.train import megatron_reference

MESH = {"data": 2, "model": 2}
model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=256, n_positions=64, n_embd=128, n_head=4)
params = model.init(cfx.random.key(0))
tokens = cfx.random.randint(cfx.random.key(1), (8, 65), 0, 256)
x, y = tokens[:, :-1], tokens[:, 1:]

# %% [markdown]
# ## The traced step
# One graph holds the forward, the backward autograd derives from it, and every gradient.

# %%
g = trace(model.loss, params, x, y)
print(len(g.ops), "ops;", f"{g.flops('forward') / 1e9:.2f} GFLOP forward, {g.flops('backward') / 1e9:.2f} backward")

# %% [markdown]
# ## The plan, against Megatron's
# `reference=` prices a hand-written layout (here Megatron's tensor parallelism over `model`) under
# the same cost model; the report says which is cheaper, lists every param's spec and the
# collectives the plan inserts.

# %%
with cfx.Mesh(MESH) as mesh:
    megatron = megatron_reference(model, mesh)
    step, report = cfx.autoshard(model.loss, mesh, (params, x, y), reference=megatron, reference_name="Megatron")
print("\n".join(str(report).splitlines()[:5]))
print(report.verdict, "| batch specs:", report.batch_specs)

# %% [markdown]
# ## The plan follows the batch
# With few rows over large weights, splitting the weights (tensor parallelism) moves fewer bytes
# than all-reducing their gradients; with many rows, data parallelism wins. Pricing both hand plans
# and the search across batch sizes shows the crossover, and the search at or below both.

# %%
dp = {path: cfx.P() for path in megatron}
rows = []
for batch in (2, 16, 128):
    tb = cfx.random.randint(cfx.random.key(2), (batch, 65), 0, 256)
    gb = trace(model.loss, params, tb[:, :-1], tb[:, 1:])
    rows.append([batch] + [search(gb, MESH, fixed=f).solution.objective * 1e3 for f in (dp, megatron, None)])
for name, col in (("data parallel", 1), ("Megatron", 2), ("searched", 3)):
    plt.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=name)
plt.xscale("log", base=2)
plt.yscale("log")
plt.xlabel("batch (sequences of 64 tokens)")
plt.ylabel("estimated step (ms)")
plt.legend()
plt.show()
for r in rows:
    assert r[3] <= min(r[1], r[2]) * 1.01  # within the search's 1% of its optimum

# %% [markdown]
# ## A memory budget
# Below the unconstrained plan's bytes per rank the search trades time for memory (more splits,
# params stored split and gathered where read, as ZeRO-3 does); below anything any assignment
# can reach it says so.

# %%
free = search(g, MESH)
budgets, times = [], []
for f in (1.0, 0.8):
    s = search(g, MESH, budget=free.solution.memory * f)
    budgets.append(s.solution.memory / 2**20)
    times.append(s.solution.objective * 1e3)
print([f"{b:.2f} MiB -> {t:.2f} ms" for b, t in zip(budgets, times)])
try:
    with cfx.Mesh(MESH) as mesh:
        cfx.autoshard(model.loss, mesh, (params, x, y), memory_budget="64KiB")
except ValueError as e:
    print(str(e)[:150])

# %% [markdown]
# ## The plan runs, and equals one device
# The returned step takes the params (put in the plan's specs once) and the batch; its loss and
# gradients are the single-device step's, to float rounding.

# %%
with cfx.Mesh(MESH) as mesh:
    step, _ = cfx.autoshard(model.loss, mesh, (params, x, y))
    loss, grads = step(step.put(params), x, y)
    want_loss, want_grads = cfx.value_and_grad(model.loss)(params, x, y)
    torch.testing.assert_close(cfx.device_get(loss), want_loss)
    cfx.tree.assert_tree_close(cfx.device_get(grads), want_grads)
print("loss", float(cfx.device_get(loss)), "= one device's", float(want_loss))
