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
# # FP8 training: the recipes, delayed scaling, and the loss curves
#
# A Linear's step runs three matmuls: the output `x w` and, in backward, `gy w^T` and `x^T gy`. In float8 each
# operand is scaled into e4m3's range (448) or e5m2's (57,344), cast with saturation, and multiplied by
# `torch._scaled_mm` -- the real kernel, which runs on the CPU too. `cfx.amp.float8(model, recipe)` runs every
# transformer block's Linears but the first block's that way (torchtitan's rule); a Plan with
# `precision=fp8[:recipe]` does it for you, on every axis it shards over.
#
# | recipe | forward | input gradient | weight gradient |
# |---|---|---|---|
# | `tensorwise` | e4m3, one scale per tensor | gy e5m2 | e4m3 x, e5m2 gy |
# | `rowwise` | e4m3, one scale per row (powers of two) | e4m3, per row | e4m3, per row |
# | `rowwise_gw_hp` | as `rowwise` | e4m3, the weight per tensor | bf16 |
# | `delayed` | `tensorwise`, the scales from earlier steps' amaxes (Transformer Engine's) | | |

# %%
# %matplotlib inline
import contextlib

import matplotlib.pyplot as plt
import torch

import cfx
from cfx._src.nn.fp8 import fp8_linear
from cfx._src.train.data import run_keys, sample_batch, stdlib_corpus, train_val_split

# %% [markdown]
# ## One Linear: how far each recipe lands from the exact product
# The relative error of the output and both gradients against fp64, next to bf16's own.

# %%
g = torch.Generator().manual_seed(0)
x, w, gy = torch.randn(256, 512, generator=g), torch.randn(512, 384, generator=g) / 20, torch.randn(256, 384, generator=g)
exact = (x.double() @ w.double(), gy.double() @ w.double().t(), x.double().t() @ gy.double())


def products(f):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = f(xr, wr)
    return (y, *torch.autograd.grad(y, (xr, wr), gy.to(y.dtype)))


rows = {"bf16": products(lambda a, b: a.bfloat16() @ b.bfloat16())}
for recipe in ("tensorwise", "rowwise", "rowwise_gw_hp"):
    rows[recipe] = products(lambda a, b, r=recipe: fp8_linear(a.bfloat16(), b, r))
print(f"{'':16}{'y':>10}{'gx':>10}{'gw':>10}")
for name, got in rows.items():
    errs = [float((a.detach().double() - e).norm() / e.norm()) for a, e in zip(got, exact)]
    print(f"{name:16}" + "".join(f"{v:10.4f}" for v in errs))

# %% [markdown]
# ## Training: bf16 against each recipe
# A GPT-2 of width 64 and 4 layers learns Python's standard library byte by byte, 60 steps of 8 x 64 bytes, the
# same init and batches for every precision. (`python -m cfx.bench fp8` runs width 128, 6 layers, 300 steps,
# three seeds each; its figures are in `docs/guide/fp8.md`.)

# %%
model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
train_data, _ = train_val_split(stdlib_corpus(1 << 20))
keys = run_keys(0)
curves, states = {}, {}
for precision in ("bf16", "fp8:tensorwise", "fp8:rowwise", "fp8:rowwise_gw_hp", "fp8:delayed"):
    step = cfx.parallel.Plan.parse(f"precision={precision}").step(model, cfx.optim.adamw(3e-3))
    state, curves[precision] = step.init(keys.init), []
    for i in range(60):
        state, m = step(state, sample_batch(train_data, cfx.random.fold_in(keys.data, i), 8, 64))
        curves[precision].append(float(m["loss"]))
    states[precision] = state
    print(f"{precision:18} first {curves[precision][0]:.3f}  last {curves[precision][-1]:.3f}")

# %%
fig, ax = plt.subplots(figsize=(6, 4))
for name, losses in curves.items():
    ax.plot(losses, label=name, lw=1)
ax.set(xlabel="step", ylabel="train loss (nats / byte)", title="GPT-2 (64 wide, 4 layers) on bytes")
ax.legend()
plt.show()

# %% [markdown]
# ## Delayed scaling's state
# Under `fp8:delayed` every float8 Linear has three slots (its input, its weight, its output's gradient), each
# with an amax history (TE's default: 1,024 steps) and the scale in use. They live in the optimizer's state --
# `cfx.amp.fp8_meta(state.opt_state)` -- so a checkpoint holds them and a resumed run scales as the one it
# continues. The first step casts with scale 1; from then on each scale is `fmax / max(history)`.

# %%
meta = cfx.amp.fp8_meta(states["fp8:delayed"].opt_state)
print(f"{meta.scale.numel()} slots ({meta.scale.numel() // 3} Linears), history {tuple(meta.history.shape)}")
first = cfx.amp.float8(model, scaling=cfx.amp.DelayedScaling()).blocks[1].linears[0][0]  # slots 0-2: block 1's first
print(f"blocks.1.{first}: x / w / gy scales", [f"{float(s):.4g}" for s in meta.scale[:3]])
print("the amaxes of its input in the last three steps:", [f"{float(a):.4g}" for a in meta.history[-3:, 0]])
