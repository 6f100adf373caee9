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
# # Pipeline schedules as data
#
# A pipeline schedule in cfx is a per-rank list of actions — forward `F`, backward `B` (or its
# zero-bubble halves `I`, input gradient, and `W`, weight gradient), and the sends and receives
# between neighbouring stages. Because it is data, it can be checked (`validate` rejects
# deadlocks, uses before existence and too many micro-batches in flight), timed (`simulate`) and
# drawn (`grid`, `plot`) before anything runs. The generators: GPipe (Huang et al. 2019), 1F1B
# (PipeDream-flush, Narayanan et al. 2021), interleaved 1F1B (Megatron-LM, Narayanan et al. 2021)
# and ZB-H1 (Qi et al. 2023). `cfx.pipeline(model, schedule)` then executes the same data over a
# `pipe` mesh axis.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P

pp = cfx.pipeline
p, m = 4, 8
schedules = {"GPipe": pp.gpipe(p, m), "1F1B": pp.one_f_one_b(p, m),
             "interleaved 1F1B (v=2)": pp.interleaved_1f1b(p, m, 2), "ZB-H1": pp.zb_h1(p, m)}
print(pp.grid(schedules["1F1B"]))

# %% [markdown]
# ## Gantt charts
# With a backward twice as costly as a forward (and, for ZB-H1, `I` and `W` one unit each), the
# idle gaps are the pipeline bubble. Interleaving shortens the fill and drain; ZB-H1 fills the
# drain with deferred weight gradients.

# %%
costs = {"F": 1, "B": 2, "I": 1, "W": 1}
fig, axes = plt.subplots(len(schedules), 1, figsize=(10, 7), sharex=True)
for ax, (name, s) in zip(axes, schedules.items()):
    pp.plot(pp.simulate(s, cost=costs), ax=ax)
    ax.set_title(name, fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Bubble vs theory
# Idle time over compute time for p = 4: GPipe and 1F1B (p-1)/m; interleaved (p-1)/(v m);
# ZB-H1 a third of 1F1B's (the paper's (p-1)(T_F + T_I - T_W) idle per rank).

# %%
ms = [4, 8, 16, 32]
theory = {"GPipe": lambda m: (p - 1) / m, "1F1B": lambda m: (p - 1) / m,
          "interleaved 1F1B (v=2)": lambda m: (p - 1) / (2 * m), "ZB-H1": lambda m: (p - 1) / (3 * m)}
make = {"GPipe": lambda m: pp.gpipe(p, m), "1F1B": lambda m: pp.one_f_one_b(p, m),
        "interleaved 1F1B (v=2)": lambda m: pp.interleaved_1f1b(p, m, 2), "ZB-H1": lambda m: pp.zb_h1(p, m)}
rows = []
fig, ax = plt.subplots(figsize=(6, 3.5))
for name in make:
    sim = [pp.simulate(make[name](mm), cost=costs).bubble_ratio for mm in ms]
    rows += [(name, mm, round(s, 4), round(theory[name](mm), 4)) for mm, s in zip(ms, sim)]
    ax.plot(ms, sim, "o-", label=name)
    ax.plot(ms, [theory[name](mm) for mm in ms], "k:", lw=0.8)
ax.set_xscale("log", base=2)
ax.set_xlabel("micro-batches m")
ax.set_ylabel("bubble (idle / compute)")
ax.legend(fontsize=8)
plt.show()
print(cfx._src.core.text.format_table(rows, ["schedule", "m", "simulated", "textbook"]))

# %% [markdown]
# ## The validator
# Swap a rank's receive after the forward that needs it and the schedule is rejected with the
# rank, the step and what to do:

# %%
s = pp.one_f_one_b(2, 4)
acts = list(s.actions[1])
i = next(j for j, a in enumerate(acts) if a.kind == "RECV_F")
acts[i], acts[i + 1] = acts[i + 1], acts[i]
broken = pp.Schedule(s.name, s.n_ranks, s.n_microbatches, s.n_chunks, (s.actions[0], tuple(acts)))
try:
    pp.validate(broken)
except pp.ScheduleError as e:
    print(e)

# %% [markdown]
# ## Running a schedule
# `cfx.pipeline(model, schedule)` is a per-rank step used inside `shard_map` over a `pipe` axis,
# like `cfx.value_and_grad(model.loss)`: it cuts the blocks into stages (balanced by parameter
# count; embeddings on the first stage, the tied head on the last), splits the batch into
# micro-batches and runs this rank's action list, with real point-to-point sends between the
# rank threads of a `local` mesh. Loss and gradients equal the single-device ones.

# %%
model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
params = model.init(cfx.random.key(0))
data = cfx.random.randint(cfx.random.key(1), (8, 33), 0, 256)
x, y = data[:, :-1], data[:, 1:]
ref_loss, ref_grads = cfx.value_and_grad(model.loss)(params, x, y)

sched = pp.one_f_one_b(2, 4)
print(pp.partition(model, 2))
with cfx.Mesh({"pipe": 2}, backend="local") as mesh, pp.trace() as tr:
    loss, grads = cfx.device_get(cfx.shard_map(pp(model, sched), mesh=mesh, in_specs=(P(), P(), P()),
                                out_specs=(P(), P()))(params, x, y))
torch.testing.assert_close(loss, ref_loss)
cfx.tree.assert_tree_close(grads, ref_grads)
print("loss", float(loss), "= single device", float(ref_loss))

# %% [markdown]
# The trace holds the measured timeline of that step (wall-clock seconds, two rank threads
# sharing this machine's cores), drawn like the simulated one:

# %%
measured = tr.timeline()
fig, ax = plt.subplots(figsize=(9, 1.8))
pp.plot(measured, ax=ax)
ax.set_title(f"1F1B, p=2, m=4, measured: bubble {measured.bubble_fraction:.2f} of the timeline "
             f"(simulated {pp.simulate(sched, cost=costs).bubble_fraction:.2f})", fontsize=9)
plt.show()
