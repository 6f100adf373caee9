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
# # Activation checkpointing: policies, and the optimal schedule for a memory budget
#
# `cfx.remat(f, policy=...)` keeps only what a policy saves for backward and recomputes the rest
# (JAX's `jax.checkpoint` policies: `nothing_saveable`, `dots_saveable`, names via
# `cfx.checkpoint_name`, offload to host). `cfx.remat.solve` goes further: it profiles a chain
# of blocks from a fake-tensor trace (no real compute), then picks which block outputs to keep
# and which segments to recompute with Rotor's dynamic program (Beaumont et al. 2019), the
# fastest schedule whose activations fit a budget. Chen et al.'s sqrt(n) segmentation (2016) is
# the baseline; their paper reports about +30% runtime for sqrt(n) memory.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import checkpoint_policies as cp

model = cfx.models.gpt2("tiny", n_layer=6, n_embd=128, n_head=4, vocab_size=512)
params = model.init(cfx.random.key(0))
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 512, (4, 128), generator=g)
targets = torch.randint(0, 512, (4, 128), generator=g)
ref_loss, ref_grads = cfx.value_and_grad(model.loss)(params, tokens, targets)

# %% [markdown]
# ## Policies per block
# Each policy wraps every block (`model.map_blocks`); values and gradients stay the same, and
# `cfx.activation_stats` shows what each block keeps for backward.

# %%
rows = []
for name, policy in [("everything_saveable", cp.everything_saveable), ("dots_saveable", cp.dots_saveable),
                     ("nothing_saveable", cp.nothing_saveable)]:
    m = model.map_blocks(lambda b: cfx.remat(b, policy=policy))
    with cfx.activation_stats() as stats:
        loss, grads = cfx.value_and_grad(m.loss)(params, tokens, targets)
    cfx.tree.assert_tree_close(grads, ref_grads)
    rows.append((name, stats.bytes(tier="device") / 2**20, stats.bytes(tier="recomputed") / 2**20))
print(cfx._src.core.text.format_table(rows, ["policy", "kept MiB", "recomputed MiB"]))

# %% [markdown]
# ## The solver's plan
# The budget covers the chain's activations: its input, what each block keeps for backward and
# the gradients flowing between blocks. The plan lists every operation with the memory held.

# %%
model_r, plan = cfx.remat.solve(model, params, tokens, budget="10MiB")
print(plan)

# %% [markdown]
# The returned model runs its blocks under the plan. It computes the same loss and gradients, and
# the executor measures the activations it really holds:

# %%
with cfx.activation_stats() as stats:
    loss, grads = cfx.value_and_grad(model_r.loss)(params, tokens, targets)
torch.testing.assert_close(loss, ref_loss)
cfx.tree.assert_tree_close(grads, ref_grads)
print("measured peak:", stats.chain_peaks[0][1] / 2**20, "MiB; plan:", plan.peak / 2**20, "MiB")

# %% [markdown]
# ## Memory vs recompute
# Sweep the budget from the no-remat peak down to the minimum and compare with Chen's sqrt(n)
# segmentation and full-block checkpointing (every block's input kept). The solver's curve lies
# on or below both baselines: at the same memory it never recomputes more.

# %%
_, no = cfx.remat.chen(model, params, tokens, segment=10**9)
_, chen = cfx.remat.chen(model, params, tokens)
_, full = cfx.remat.chen(model, params, tokens, segment=1)
lo = cfx.remat.minimum_budget(model, params, tokens)
budgets = torch.linspace(lo, no.peak, 24).long().tolist()
curve = [cfx.remat.solve(model, params, tokens, budget=b)[1] for b in budgets]

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.step([p.peak / 2**20 for p in curve], [100 * p.recompute_fraction for p in curve], where="post",
        label="Rotor (optimal)")
for p, mark in [(chen, "s"), (full, "^"), (no, "o")]:
    ax.plot(p.peak / 2**20, 100 * p.recompute_fraction, mark, label=p.method if p is not no else "no remat")
ax.set_xlabel("peak activation memory (MiB)")
ax.set_ylabel("recomputed FLOPs (% of fwd+bwd)")
ax.legend()
ax.set_title("GPT-2 (6 blocks): memory vs recompute")
plt.show()

# %% [markdown]
# For GPT-2 small on a 2-core CPU, `python -m cfx.bench remat` measures this curve with real
# step times; the docs list its figures. A budget below the minimum is refused with the minimum:

# %%
try:
    cfx.remat.solve(model, params, tokens, budget=lo - 1)
except ValueError as e:
    print(e)
