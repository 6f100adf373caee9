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
# # Plans for clusters you do not have: `cfx.parallel.estimate`
#
# `cfx.parallel.estimate(model, plan, cluster, batch=(rows, seq))` predicts a training step's time, MFU and
# memory per GPU on a `cfx.parallel.Cluster` -- a GPU kind, how many, how they are linked -- without allocating
# anything. This notebook checks it against published Megatron-LM runs (one set of A100 constants for every
# row), then looks at GPT-3 175B on 1,024 A100s: which plans fit, and how fast each would run.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt

import cfx
from cfx._src.estimate import published

# %% [markdown]
# ## Against the papers
#
# Korthikanti et al. 2022 Table 5 (seconds per iteration, 22B-1T on 8-512 A100s, full recomputation and
# sequence parallelism + selective recomputation) and Narayanan et al. 2021 Table 1 (teraFLOP/s per GPU,
# 1.7B-1T on 32-3,072 A100s), each estimated as Megatron-LM ran it (`stack="megatron"`).

# %%
table5 = published.check(published.korthikanti_table5())
table1 = published.check(published.narayanan_table1())
for run, value, err in table5 + table1:
    print(f"{run.source[:24]:24s} {run.name:20s} paper {run.value:8.2f} {run.unit:8s} estimate {value:8.2f}  {err:+.1%}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, rows, what in ((axes[0], table5, "seconds per iteration"), (axes[1], table1, "TFLOP/s per GPU")):
    paper = [r.value for r, _, _ in rows]
    est = [v for _, v, _ in rows]
    lo, hi = min(paper + est) * 0.9, max(paper + est) * 1.1
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="0.9", label="within 5%")
    ax.scatter(paper, est, zorder=3)
    for (r, v, _) in rows:
        ax.annotate(r.name.split()[0], (r.value, v), fontsize=7, xytext=(3, -8), textcoords="offset points")
    if rows is table5:
        ax.set_xscale("log"), ax.set_yscale("log")
    ax.set(xlabel=f"paper: {what}", ylabel="estimate", title=rows[0][0].source)
    ax.legend(loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## GPT-3 175B on 1,024 A100s
#
# Every plan over pipe x data x seq x model with ZeRO-1, selective recomputation (`remat=dots`) and the 1F1B
# schedule (`cfx.parallel.search` also tries ZeRO 0/2/3, remat none / blocks, interleaving and ZB-H1: 13,311
# plans in about 10 s), estimated on the model's shape: MFU against memory per GPU.

# %%
from cfx._src.estimate.search import candidates

gpt3 = cfx.parallel.TransformerShape.gpt(12288, 96, 96, name="GPT-3 175B")
cluster = cfx.parallel.Cluster.preset("a100-80gb", gpus=1024)
plans = [p for p in candidates(gpt3, 1024, 1536, 2048) if p.zero == 1 and p.remat == "dots" and p.schedule == "1f1b"]
estimates = [cfx.parallel.estimate(gpt3, p, cluster, batch=(1536, 2048)) for p in plans]
fits = [e for e in estimates if e.fits]
print(f"{len(estimates)} plans, {len(fits)} fit in {cluster.gpu.memory / 1e9:.0f} GB")

# %%
fig, ax = plt.subplots(figsize=(6, 4))
for group, colour in ((fits, "tab:blue"), ([e for e in estimates if not e.fits], "tab:red")):
    ax.scatter([e.memory_bytes / 2**30 for e in group], [e.mfu for e in group], s=8, c=colour,
               label="fits" if group is fits else "does not fit")
ax.axvline(cluster.gpu.memory / 2**30, color="k", lw=0.8)
ax.set(xscale="log", xlabel="memory per GPU (GiB)", ylabel="MFU", title="GPT-3 175B, batch 1536 x 2048, 1,024 A100s")
ax.legend()
plt.show()

# %%
best = max(fits, key=lambda e: e.mfu)
print(best)
