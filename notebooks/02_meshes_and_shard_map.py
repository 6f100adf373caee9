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
# # Meshes and `shard_map`
#
# cfx names devices with a mesh (`{"data": 2, "model": 2}`) and writes SPMD programs the JAX way:
# a per-rank function plus `in_specs`/`out_specs`, with collectives addressed by axis name. The
# `local` backend runs each rank as a thread with real gloo process groups, so this notebook runs
# on a laptop CPU; the same code runs one process per rank under `torchrun`. We show collectives,
# `shard_map` and the `ShardedArray`s it takes and returns, resharding with its byte count,
# gradients through `shard_map`, and GPT-2 under data x Megatron tensor parallelism (Shoeybi et
# al. 2019, Fig. 3: column- then row-parallel layers, one all-reduce per block half) whose
# parameters are built sharded and stay sharded, with the communication it cost.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P

mesh = cfx.Mesh({"data": 2, "model": 2}, backend="local")
print(mesh, "ranks:", [mesh.coords(r) for r in range(mesh.size)])

# %% [markdown]
# ## Collectives by axis name
# `x` is 2 x 2 and each rank holds one element (`P("data", "model")`). `psum` over `"model"` sums
# each row; over `"data"` each column; `axis_index` is the rank's position along an axis.

# %%
x = torch.tensor([[1.0, 2.0], [10.0, 20.0]])


def per_rank(f):
    return cfx.shard_map(f, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"))


print(per_rank(lambda b: cfx.lax.psum(b, "model"))(x))  # a ShardedArray: global shape, spec, mesh
print(cfx.device_get(per_rank(lambda b: cfx.lax.psum(b, "model"))(x)))  # its global value
print(cfx.device_get(per_rank(lambda b: cfx.lax.psum(b, "data"))(x)))
print(cfx.device_get(per_rank(lambda b: b * 0 + cfx.lax.axis_index("model"))(x)))

# %% [markdown]
# ## `shard_map`
# A row-sum of a matrix split both ways: each rank sums its block, then a `psum` over `"model"`
# completes the rows. The output is split over `"data"` only. Outputs are `ShardedArray`s: each
# process keeps its ranks' blocks, nothing is gathered until `cfx.device_get` asks for it.

# %%
a = torch.arange(16.0).reshape(4, 4)
rowsum = cfx.shard_map(lambda blk: cfx.lax.psum(blk.sum(1), "model"),  # blk (2, 2) -> (2,)
                       mesh=mesh, in_specs=P("data", "model"), out_specs=P("data"))
out = rowsum(a)
print(out, torch.equal(cfx.device_get(out), a.sum(1)))

# %% [markdown]
# ## `device_put` and `reshard`
# A `ShardedArray` holds one block per rank. `reshard_plan` searches for the cheapest sequence of
# collectives between two layouts and compares its bytes with the naive gather-then-split.
# `shard_map` uses a block as is when its spec matches the in_spec, and runs that plan inside the
# ranks when it does not.

# %%
arr = cfx.device_put(torch.arange(64.0).reshape(8, 8), mesh, P("data", None))
print({r: tuple(b.shape) for r, b in arr.blocks.items()})
print(cfx.reshard_plan(arr, P(None, "data")))

# %%
moved = cfx.reshard(arr, P(None, "data"))
print(moved.spec, moved.block_shape, torch.equal(moved.gather(), arr.gather()))
print(cfx.device_get(rowsum(cfx.device_put(a, mesh, P(None, "data")))))  # resharded on the way in

# %% [markdown]
# ## Gradients through `shard_map`
# `cfx.grad` differentiates through `shard_map` with JAX's semantics. Every value in a body knows
# the mesh axes it varies over (`cfx.lax.varying_axes`); where a replicated value meets a varying
# one, it is implicitly `pvary`'d, so its cotangent is summed over that axis. Below `w` is
# replicated and the batch is split over `"data"`: `w`'s gradient is the sum over both shards, as
# on one device. Gradients come back as `ShardedArray`s laid out like the inputs.

# %%
xs, w = torch.randn(8, 4), torch.randn(4)


def sq_loss(xb, w):
    y = xb @ w
    if cfx.lax.axis_index(("data", "model")) == 0:  # one rank reports
        print("varying over: x @ w", set(cfx.lax.varying_axes(y)), " w", set(cfx.lax.varying_axes(w)))
    return cfx.lax.psum((y ** 2).sum(), "data")


sharded_loss = cfx.shard_map(sq_loss, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
g = cfx.grad(lambda w: sharded_loss(xs, w))(cfx.device_put(w, mesh))
torch.testing.assert_close(cfx.device_get(g), cfx.grad(lambda w: ((xs @ w) ** 2).sum())(w))
print(g)

# %% [markdown]
# ## GPT-2 under data x tensor parallelism
# Parallelism is a set of rules from the model's logical axes to mesh axes; `tensor_parallel`
# inserts Megatron's `f`/`g` collectives into each block. The model itself is unchanged.

# %%
model = cfx.models.gpt2("tiny", vocab_size=256)
rules = cfx.Rules({"batch": "data", **cfx.parallel.MEGATRON_RULES})
specs = rules.specs(model.axes())
print("q:", specs["blocks"][0]["attn"]["q"], " o:", specs["blocks"][0]["attn"]["o"])
tp_model = cfx.parallel.tensor_parallel(model, "model")

params = cfx.init_sharded(model.init, cfx.random.key(0), mesh=mesh, specs=specs)  # no full copy anywhere
print(params["blocks"][0]["attn"]["q"]["w"])
tokens = cfx.random.randint(cfx.random.key(1), (4, 33), 0, 256)  # (B, T + 1)

# %% [markdown]
# One training step's loss and gradients, per rank: a (2, 33) batch shard and Megatron-sharded
# params. Data parallelism is explicit: average the loss and sync the gradients over `"data"`
# (`tree_pmean` does it as one bucketed all-reduce).


# %%
def loss_and_grads(p, t):
    loss, grads = cfx.value_and_grad(lambda p: tp_model.loss(p, t[:, :-1], t[:, 1:]))(p)
    return cfx.lax.pmean(loss, "data"), cfx.parallel.tree_pmean(grads, "data")


step = cfx.shard_map(loss_and_grads, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
with cfx.comm_stats() as stats:
    loss, grads = step(params, tokens)

# %% [markdown]
# The same on one device, for reference: losses and every gradient leaf agree.

# %%
full = model.init(cfx.random.key(0))  # the same values, bit for bit
ref_loss, ref_grads = cfx.value_and_grad(lambda p: model.loss(p, tokens[:, :-1], tokens[:, 1:]))(full)
print(f"DP x TP loss {loss.item():.6f}   single device {ref_loss.item():.6f}")
torch.testing.assert_close(cfx.device_get(loss), ref_loss)
cfx.tree.assert_tree_close(cfx.device_get(grads), ref_grads, rtol=1e-4, atol=1e-6)
print("all", len(cfx.tree.leaves(grads)), "gradient leaves match")

# %% [markdown]
# ## What it cost
# Per rank, over `"model"`: two all-reduces per block in the forward (Megatron's `g` after
# attention and after the MLP; 4 blocks) plus those of the vocab-parallel embedding and
# cross-entropy, and their transposes (`f`) in the backward. Over `"data"`: the loss `pmean` and
# one all-reduce of every gradient.

# %%
print(stats.table())

# %%
rows = stats.summary()  # (axes, op, phase, calls/rank, bytes/rank)
labels = [f"{op}\n{axes}, {phase}" for axes, op, phase, _, _ in rows]
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(labels, [r[4] / 1024 for r in rows])
ax.set(ylabel="KiB per rank", title="GPT-2 tiny train step, data=2 x model=2")
plt.show()

# %%
mesh.close()
