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
# # Pytrees and models
#
# In cfx a model is a frozen dataclass of pure functions and its parameters are a plain pytree
# (nested dicts of tensors), as in JAX/Flax. This notebook walks through explicit random keys,
# one layer, a GPT-2 forward pass, a round trip through Hugging Face's `GPT2LMHeadModel`
# (built from a config, nothing downloaded; the logits must agree to float precision), and a few
# training steps with the optax-shaped `cfx.optim`, ending with a plot of the loss curve.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx

# %% [markdown]
# ## Keys and split
# Randomness is explicit: a key is a tensor, `split` derives independent children, and the same
# key always gives the same numbers (on any thread, process or device).

# %%
key = cfx.random.key(0)
k_init, k_data = cfx.random.split(key, 2)
a = cfx.random.normal(k_data, (3,))
b = cfx.random.normal(k_data, (3,))
print(key, a, torch.equal(a, b))

# %% [markdown]
# ## A layer
# Layers have `init(key) -> params`, a pure `apply(params, x)` and `axes()` naming each dim.

# %%
layer = cfx.nn.Linear(4, 3)
p = layer.init(k_init)
print({k: tuple(v.shape) for k, v in p.items()}, layer.axes())
print(layer.apply(p, torch.ones(2, 4)))  # (2, 4) -> (2, 3)

# %% [markdown]
# ## A GPT-2 forward
# The params are one pytree; leaves have dotted paths.

# %%
model = cfx.models.gpt2("tiny", vocab_size=256)
params = model.init(k_init)
paths = cfx.tree.leaf_paths(params)
print(f"{cfx.tree.tree_size(params):,} params in {len(paths)} leaves, e.g. {paths[:3]}")

tokens = cfx.random.randint(k_data, (2, 16), 0, 256)  # (B, T)
logits = model.apply(params, tokens)                   # (B, T, V)
print(tuple(logits.shape))

# %% [markdown]
# ## To and from Hugging Face
# `to_hf` gives a state dict for `transformers.GPT2LMHeadModel`; `from_hf` reads one back.

# %%
import transformers

hf_model = transformers.GPT2LMHeadModel(model.hf_config()).eval()
hf_model.load_state_dict(cfx.models.to_hf(model, params), strict=True)
with torch.no_grad():
    hf_logits = hf_model(tokens).logits
print("max |cfx - HF| logit difference:", (logits - hf_logits).abs().max().item())

_, params_back = cfx.models.from_hf(hf_model)
print("round trip exact:", cfx.tree.tree_allclose(params_back, params, rtol=0, atol=0))

# %% [markdown]
# ## Training a few steps
# Byte-level language modelling on a piece of the Python standard library's source.
# `update` is pure: it returns new updates and a new state, nothing is modified in place.

# %%
import inspect
import json

data = torch.tensor(list(inspect.getsource(json.decoder).encode()), dtype=torch.long)
starts = cfx.random.randint(cfx.random.key(1), (40, 8), 0, len(data) - 65)
batches = [torch.stack([data[s:s + 65] for s in row.tolist()]) for row in starts]  # 40 x (8, 65)

tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(1.0), cfx.optim.adamw(3e-3, weight_decay=0.1))
opt_state = tx.init(params)

# %%
losses = []
for batch in batches:
    loss, grads = cfx.value_and_grad(model.loss)(params, batch[:, :-1], batch[:, 1:])
    updates, opt_state = tx.update(grads, opt_state, params)
    params = cfx.optim.apply_updates(params, updates)
    losses.append(loss.item())
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")

# %%
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(losses)
ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="GPT-2 tiny, bytes of json/decoder.py")
plt.show()
