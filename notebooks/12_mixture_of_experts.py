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
# # Mixture of experts: routing, load balance and the expert-parallel layout
#
# A mixture-of-experts layer (`cfx.nn.MoE`) replaces a block's MLP by `E` expert MLPs and a
# router: each token goes to its `top_k` experts, so the model holds `E` MLPs' weights while a
# token pays for `k`. This notebook looks at where tokens go, watches the load-balancing loss
# even out the experts while a small Mixtral trains, and draws what expert parallelism sends
# between ranks.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx import P

E, K = 8, 2
model = cfx.models.mixtral("tiny", vocab_size=256, hidden_size=64, intermediate_size=96, n_layer=2,
                           n_head=4, n_kv_heads=2, n_experts=E, top_k=K, max_position_embeddings=64,
                           router_aux_loss_coef=0.05)
params = model.init(cfx.random.key(0))
import inspect
text = inspect.getsource(torch.nn.functional).encode()  # bytes of a Python module: a small corpus
data = torch.tensor(list(text[:8 * 33 * 40]), dtype=torch.long).view(40, 8, 33)

# %% [markdown]
# ## Where the tokens go
# `router_stats` runs the blocks and returns each layer's `RouterStats`: how many (token, expert)
# rows each expert got (`counts`, summing to `tokens x k`) and its summed router probability.

# %%
_, stats = model.router_stats(params, data[0, :, :-1])
fig, axes = plt.subplots(1, 2, figsize=(9, 2.5), sharey=True)
for layer, (ax, s) in enumerate(zip(axes, stats)):
    ax.bar(range(E), s.counts.tolist())
    ax.set_title(f"layer {layer}: rows per expert at init")
    ax.set_xlabel("expert")
assert all(int(s.counts.sum()) == 8 * 32 * K for s in stats)

# %% [markdown]
# ## Balance over training
# The load-balancing loss `E * sum_e f_e P_e` (Switch Transformer; what transformers adds to
# Mixtral's loss) is 1 when the rows and the probability are spread evenly and grows with the
# imbalance. Trained with it, the busiest expert's share comes down.

# %%
tx = cfx.optim.adamw(3e-3)
opt_state, history = tx.init(params), []
for step in range(40):
    x, y = data[step, :, :-1], data[step, :, 1:]
    loss, grads = cfx.value_and_grad(model.loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = cfx.optim.apply_updates(params, updates)
    _, stats = model.router_stats(params, x)
    total = sum(stats[1:], stats[0])
    history.append((float(loss), float(cfx.nn.load_balancing_loss(total)),
                    float(total.counts.max() / total.counts.mean())))
loss_curve, balance, busiest = zip(*history)
fig, axes = plt.subplots(1, 3, figsize=(12, 2.5))
for ax, curve, title in zip(axes, (loss_curve, balance, busiest),
                            ("loss (with 0.05 x balance)", "load-balancing loss", "busiest expert / mean")):
    ax.plot(curve)
    ax.set_title(title)
    ax.set_xlabel("step")
print(f"loss {loss_curve[0]:.2f} -> {loss_curve[-1]:.2f}; busiest expert {busiest[0]:.2f}x -> {busiest[-1]:.2f}x the mean")

# %% [markdown]
# ## Expert parallelism
# With the experts split over an `expert` axis of N ranks (`cfx.parallel.expert_parallel`), each
# rank holds E/N experts and its share of the batch; every (token, expert) row travels to its
# expert's rank and back with `cfx.lax.ragged_all_to_all`. The matrix below is what the first
# layer sends from each rank to each other (rows, forward; the backward sends the same back), and
# the result equals one device.

# %%
N = 4
ep = cfx.parallel.expert_parallel(model)
x = data[0, :, :-1]
with cfx.Mesh({"expert": N}) as mesh, cfx.comm_stats() as comm:
    specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(model.axes(), mesh=mesh)
    logits = cfx.shard_map(lambda p, x: ep.apply(p, x), mesh=mesh, in_specs=(specs, P("expert")),
                           out_specs=P("expert"))(params, x)
torch.testing.assert_close(cfx.device_get(logits), model.apply(params, x), rtol=1e-4, atol=1e-4)

sent = torch.zeros(N, N)  # the first layer's rows from each rank's tokens to each expert's rank
for r, share in enumerate(x.view(N, -1, x.shape[1])):
    _, stats = model.router_stats(params, share)
    sent[r] = stats[0].counts.view(N, E // N).sum(1)
plt.figure(figsize=(3.5, 3))
plt.imshow(sent, cmap="Blues")
plt.colorbar(label="rows")
plt.xlabel("to rank")
plt.ylabel("from rank")
plt.title("rows per (source, expert rank)")
print("bytes sent between ranks, every layer, forward:", comm.bytes(op="ragged_all_to_all"))
