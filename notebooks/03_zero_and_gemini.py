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
# # ZeRO stages 1-3 and Gemini placement
#
# `cfx.zero(tx, stage=, axis="data")` wraps any `cfx.optim` transformation inside `shard_map`:
# stage 1 shards the optimizer state (fp32 master, Adam moments) over the data axis, stage 2
# also the gradients (reduce-scattered in buckets during backward), stage 3 also the parameters
# (`cfx.zero.gathered` layers all-gather their shard just before they run and free it after).
# Rajbhandari et al. (2020, Fig. 1) give the per-rank model-state bytes for mixed-precision Adam
# with Psi parameters on N ranks: 16Psi, 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N. Here
# `cfx.memory` measures them.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P

N = 4
model = cfx.models.gpt2("tiny", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=16)
params = cfx.tree.map(lambda x: x.to(torch.bfloat16), model.init(cfx.random.key(0)))  # bf16 params
psi = cfx.tree.tree_size(params)
tokens = cfx.random.randint(cfx.random.key(1), (8, 17), 0, 256)


def gathered(m):  # stage 3: every block, then the model's own embeddings and head
    return cfx.zero.gathered(m.map_blocks(lambda b: cfx.zero.gathered(b, axis="data")), axis="data")


def one_step(stage, mem):
    net = gathered(model) if stage == 3 else model
    ztx = cfx.zero(cfx.optim.adamw(1e-3), stage=stage, axis="data")

    def body(params, t):
        p = cfx.zero.shard_params(params, axis="data") if stage == 3 else cfx.tree.map(torch.clone, params)
        state = ztx.init(p)
        with cfx.comm_stats() as stats:
            _, grads = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
            rank = cfx.lax.axis_index("data")
            held = sum(mem.live("device", rank=rank, kind=k) for k in ("param", "grad", "optim"))
            updates, state = ztx.update(grads, state, p)
        moved = sum(r.numel for r in stats.records if r.rank == int(rank))
        return torch.tensor([held]), torch.tensor([moved])

    with cfx.Mesh({"data": N}) as mesh:
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P("data")))(
            params, tokens))


formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N, 3: 16 * psi / N}
measured = {}
with cfx.memory.track() as mem:
    for stage in range(4):
        held, _ = one_step(stage, mem)
        measured[stage] = int(held[0])
rows = [(s, measured[s], int(formula[s]), f"{measured[s] / formula[s]:.6f}") for s in range(4)]
print(f"Psi = {psi:,} parameters, N = {N}")
print(cfx._src.core.text.format_table(rows, ["stage", "measured B/rank", "ZeRO formula", "ratio"]))

fig, ax = plt.subplots(figsize=(5, 3))
ax.bar([s - 0.2 for s in range(4)], [measured[s] / 2**20 for s in range(4)], width=0.4, label="measured")
ax.bar([s + 0.2 for s in range(4)], [formula[s] / 2**20 for s in range(4)], width=0.4, label="formula")
ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
ax.set_ylabel("model states per rank (MiB)")
ax.legend()
plt.show()

# %% [markdown]
# The measured bytes sit within one chunk of the formulas (the padding that makes every shard the
# same size). Each stage also equals the single-device run step for step; the test suite checks
# that on `{"data": 4}` and `{"data": 2, "model": 2}`.
#
# ## State that stays sharded across steps
# Above, each call started from global params. A training run keeps its state sharded instead:
# `cfx.zero.init_params` builds each rank's pieces straight from `model.init` (no rank ever holds
# the model), the optimizer state is made inside `shard_map`, and every step takes and returns
# `ShardedArray`s. With `donate_argnums` the step writes the new params and moments into the old
# buffers (Adam's moments are updated in place), so between steps each rank holds exactly its
# 16 Psi/N bytes (fp32 here: 4 for params, 8 for the moments, 4 for the gradients while they live).

# %%
ztx = cfx.zero(cfx.optim.adamw(1e-3), stage=3, axis="data")
zmodel = gathered(model)


def zero3_step(p, state, t):  # per rank: its pieces, its batch shard
    loss, grads = ztx.value_and_grad(lambda p: zmodel.loss(p, t[:, :-1], t[:, 1:]))(p)
    updates, state = ztx.update(grads, state, p)
    return cfx.optim.apply_updates(p, updates), state, cfx.lax.pmean(loss, "data")


with cfx.Mesh({"data": N}) as mesh:
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))  # no allocation: shapes and dtypes only
    zspecs = cfx.zero.param_specs(None, shapes, axis="data", mesh=mesh)
    sspecs = ztx.state_specs(shapes, mesh=mesh)
    zparams = cfx.zero.init_params(model.init, cfx.random.key(0), mesh=mesh, axis="data")
    zstate = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(zspecs,), out_specs=sspecs)(zparams)
    step = cfx.shard_map(zero3_step, mesh=mesh, in_specs=(zspecs, sspecs, P("data")),
                         out_specs=(zspecs, sspecs, P()), donate_argnums=(0, 1))
    for i in range(3):
        zparams, zstate, loss = step(zparams, zstate, tokens)
        print(f"step {i}: loss {float(loss):.4f}")
    leaf = zparams.pieces["blocks"][0]["attn"]["q"]["w"]
    print(leaf, {r: tuple(b.shape) for r, b in leaf.blocks.items()})
    held = sum(x.addressable_nbytes for x in cfx.tree.leaves((zparams, zstate))) // N
    print(f"params + AdamW state per rank: {held:,} B = {held / (12 * cfx.tree.tree_size(shapes) / N):.4f} "
          "x 12 Psi/N (fp32)")

# %% [markdown]
# ## Gemini: chunks placed under a device budget
# Behind stage 3, `cfx.zero.GeminiEngine` packs the gathered layers' shards, in execution order,
# into equal-size chunks (the size chosen by a search that minimises padding) kept in a tier store
# (device, host or a file-backed NVMe store). With `cfx.gemini.auto(budget)` a warm-up
# step records how much non-model memory (activations) is live at each chunk access; afterwards
# the engine evicts the chunk needed furthest in the future (Belady) so that chunks plus
# activations stay under the budget. The plot shows device bytes over one step.

# %%
big = cfx.models.gpt2("tiny", n_layer=6, n_embd=128, n_head=4, vocab_size=256, n_positions=32)
zbig = gathered(big)
bparams = big.init(cfx.random.key(0))
batch = cfx.random.randint(cfx.random.key(2), (2, 8, 33), 0, 256)


def train(placement, track=None):
    def body(params, batches):
        eng = cfx.zero.GeminiEngine(zbig, cfx.zero.shard_params(params, axis="data"), cfx.optim.adamw(1e-3),
                                    axis="data", offload=placement)
        losses = []
        for t in batches:
            if track is None:
                losses.append(eng.backward(lambda p: zbig.loss(p, t[:, :-1], t[:, 1:])).reshape(1))
            else:
                with track.track_ops("device"):
                    losses.append(eng.backward(lambda p: zbig.loss(p, t[:, :-1], t[:, 1:])).reshape(1))
            eng.update()
        return torch.cat(losses), eng
    with cfx.Mesh({"data": 2}) as mesh:
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=(P("data"), P()))(
            bparams, batch))


_, warm = train(cfx.zero.offload(cfx.gemini.auto(1 << 30)))
rec = warm.record
least = max(rec.chunk_bytes[a[0]] + nm for a, nm in zip(rec.accesses, rec.non_model_bytes))
everything = max(rec.non_model_bytes) + sum(rec.chunk_bytes)
budget = (least + everything) // 2
print(f"one layer at a time needs {least:,} B, everything resident {everything:,} B; budget {budget:,} B")

with cfx.memory.track() as mem:
    losses, eng = train(cfx.zero.offload(cfx.gemini.auto(budget)), track=mem)
print(f"tracked device peak {mem.peak('device', rank=0):,} B <= budget; host->device {eng.traffic['host->device']:,} B")
cs = eng.chunk_search  # equal-size chunks, the size searched to minimise padding
print(f"{cs.n_chunks} chunks of {cs.size:,} elements per rank; waste {cs.waste:,} elements ({cs.waste_fraction:.1%})")
steps, live = zip(*mem.timeline("device", rank=0))
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(steps, [b / 2**10 for b in live], lw=0.8, label="device bytes (rank 0)")
ax.axhline(budget / 2**10, color="r", ls="--", label="budget")
ax.set_xlabel("allocation event")
ax.set_ylabel("KiB")
ax.legend()
plt.show()

# %% [markdown]
# Every placement — `device`, `host`, `auto`, and `host` with an NVMe directory — gives the same
# parameters bit for bit as functional stage 3 in fp32 (tested). A budget smaller than the
# largest single layer plus its activations is refused before anything runs:

# %%
try:
    train(cfx.zero.offload(cfx.gemini.auto(10_000)))
except ValueError as e:
    print(str(e).splitlines()[0])
