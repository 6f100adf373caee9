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
# # Sequence parallelism: the ring's schedule and the memory curve
#
# With the sequence split over a `seq` axis of N ranks, each rank holds T/N positions of every
# sequence. Everything position-wise (embeddings, norms, MLPs, the head) runs on them unchanged;
# attention needs every key, and **ring attention** (Li et al., 2021) brings them: each rank keeps
# its queries, the key/value blocks go round the ring with `ppermute`, and each step's partial
# attention joins the running result by its log-sum-exp (flash attention's online softmax). The
# backward is a ring too. This notebook draws the ring's schedule, checks it against one device,
# and measures what it is for: activation memory per rank that falls as 1/N.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P
from cfx.parallel import ring_attention, zigzag_indices

N, T = 4, 32

# %% [markdown]
# ## The schedule
# At step s, rank r holds the key block that started on rank (r - s) mod N. Under a causal mask a
# query sees only earlier keys, so with contiguous blocks rank 0 has work at step 0 only while
# rank N-1 works at every step. The **zigzag** layout gives rank r chunks r and 2N-1-r of 2N
# equal chunks, so every rank computes the same number of (query, key) pairs at every step: the
# ring is balanced.

# %%
def visible_pairs(positions):
    """(ranks, steps): causal (query, key) pairs rank r computes at step s."""
    work = torch.zeros(N, N, dtype=torch.long)
    for r in range(N):
        for s in range(N):
            q, k = positions[r], positions[(r - s) % N]
            work[r, s] = (k[None, :] <= q[:, None]).sum()
    return work


layouts = {"contiguous": torch.arange(T).view(N, -1), "zigzag": zigzag_indices(T, N).view(N, -1)}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, (name, positions) in zip(axes, layouts.items()):
    work = visible_pairs(positions)
    ax.imshow(work, cmap="Blues", vmin=0)
    for r in range(N):
        for s in range(N):
            ax.text(s, r, f"kv{(r - s) % N}\n{int(work[r, s])}", ha="center", va="center", fontsize=8)
    ax.set(title=f"{name}: block held, pairs computed", xlabel="ring step", ylabel="rank",
           xticks=range(N), yticks=range(N))
plt.tight_layout()
print("zigzag: pairs per rank", visible_pairs(layouts["zigzag"]).sum(1).tolist(),
      "| contiguous:", visible_pairs(layouts["contiguous"]).sum(1).tolist())

# %% [markdown]
# ## What goes on the wire, and that it is exact
# `cfx.comm_stats` records every collective each rank issues. Forward: N-1 hops of the (k, v)
# block. Backward: N-1 hops of it again and N hops of its fp32 gradient accumulators (the last
# one brings them home). The result equals one device's attention, gradients included.

# %%
B, H, D = 2, 4, 16
q, k, v = (cfx.random.normal(cfx.random.key(i), (B, T, H, D)) for i in range(3))
order = zigzag_indices(T, N)


def ring(q, k, v):  # each rank: its (B, T/N, H, D) positions in zigzag order
    def loss(q, k, v):  # this rank's share of sum(out ** 2)
        out = ring_attention(q, k, v, "seq", causal=True)
        return (out ** 2).sum(), out
    (_, out), grads = cfx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


with cfx.Mesh({"seq": N}) as mesh, cfx.comm_stats() as stats:
    spec = P(None, "seq")
    out, grads = cfx.device_get(cfx.shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec),
                                              out_specs=(spec, (spec,) * 3))(q[:, order], k[:, order], v[:, order]))
want = cfx.nn.attention(q, k, v, causal=True)
want_grads = cfx.grad(lambda q, k, v: (cfx.nn.attention(q, k, v, causal=True) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
torch.testing.assert_close(out, want[:, order])
for g, w in zip(grads, want_grads):
    torch.testing.assert_close(g, w[:, order])
for phase in (False, True):
    recs = [r for r in stats.select(rank=0) if r.backward == phase]
    print(("backward" if phase else "forward ") + ":", [f"{r.op} {r.nbytes} B" for r in recs])

# %% [markdown]
# ## The memory curve
# Activation bytes per rank of one training step (forward + backward of a 2-layer GPT-2, width 64,
# 4 heads) from `cfx.memory.track(ops=True)`, which books every op output and saved tensor of
# each rank. One device and Megatron tensor parallelism over 4 ranks against ring and Ulysses over
# 4: the sequence-parallel methods hold about a quarter of one device's activations at every
# length; tensor parallelism keeps its norms, residuals and the blocks' inputs whole on every rank.
# `python -m cfx.bench sequence` turns these curves into the longest sequence a per-rank budget
# trains (the `<method>_max_seq_vs_tp` rows).

# %%
from cfx.bench.sequence_memory import activation_peak

lengths = [128, 256, 512, 1024]
curves = {name: [activation_peak(method, t) / 2**20 for t in lengths]
          for name, method in [("one device", "one"), ("TP, model=4", "tp"), ("ring, seq=4", "ring"),
                               ("Ulysses, seq=4", "ulysses")]}
fig, ax = plt.subplots(figsize=(6, 4))
for name, mib in curves.items():
    ax.plot(lengths, mib, marker="o", label=name)
ax.set(xlabel="sequence length T", ylabel="activation MiB per rank (peak)", title="GPT-2, one step")
ax.legend()
for name, mib in curves.items():
    print(f"{name:15s}", " ".join(f"{m:6.2f}" for m in mib), "MiB")

# %% [markdown]
# ## In a Plan
# `Plan.parse("seq=4")` (ring; `sp=ulysses` for Ulysses, `model=N sp=megatron` for Megatron-SP)
# puts the batch's positions in the zigzag order, splits them over `seq` and sums each rank's
# gradient share; the same from the command line: `python -m cfx.train --mesh seq=4 --sp ring`.

# %%
from cfx.parallel import Plan

model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=64, n_positions=T)
tx = cfx.optim.adamw(1e-3)
batch = cfx.random.randint(cfx.random.key(7), (4, T + 1), 0, 64)
x, y = batch[:, :-1], batch[:, 1:]
params = model.init(cfx.random.key(0))
ref_loss, g = cfx.value_and_grad(model.loss)(params, x, y)
plan = Plan.parse("seq=4")
with plan.make_mesh() as mesh:
    step = plan.step(model, tx, mesh=mesh)
    state, metrics = step(step.init(cfx.random.key(0)), (x, y))
    torch.testing.assert_close(float(metrics["loss"]), float(ref_loss))
print(plan, "| loss", float(metrics["loss"]), "= one device", float(ref_loss))
