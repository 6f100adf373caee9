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
# # Fused kernels against their references, and GPT-2 in int8
#
# `cfx_kernels` holds Triton kernels — flash attention (Dao et al. 2022) forward and backward,
# layer/RMS norm, softmax cross-entropy, a flat AdamW step, and an int8 weight-only matmul —
# each beside a plain-PyTorch reference. `impl="auto"` picks Triton on CUDA and the reference
# elsewhere. On a CPU the kernels still run, through Triton's interpreter (`TRITON_INTERPRET=1`),
# which is how this notebook (and the test suite) checks them against their references.

# %%
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel launches: run Triton on CPU tensors

# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import cfx
from cfx_kernels.adamw import adamw_flat_
from cfx_kernels.attention_reference import attention_reference
from cfx_kernels.cross_entropy import cross_entropy
from cfx_kernels.flash_attention import flash_attention
from cfx_kernels.int8_matmul import int8_matmul, quantize_weight
from cfx_kernels.norms import layer_norm, rms_norm

g = torch.Generator().manual_seed(0)
randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731

# %% [markdown]
# ## Each kernel vs its reference (fp32)
# Same inputs through `impl="triton"` and `impl="reference"`; the table shows the largest
# absolute difference, forward and (where the kernel has one) backward.

# %%
def max_err(a, b):
    return (a - b).abs().max().item()


rows = []
q, k, v = (randn(1, 64, 2, 16).requires_grad_() for _ in range(3))
out_t = flash_attention(q, k, v, causal=True, impl="triton")
out_r = attention_reference(q, k, v, causal=True)
grads_t = torch.autograd.grad(out_t.square().sum(), (q, k, v))
grads_r = torch.autograd.grad(out_r.square().sum(), (q, k, v))
rows.append(("flash_attention", max_err(out_t, out_r), max(max_err(a, b) for a, b in zip(grads_t, grads_r))))

x, w, b = randn(8, 64).requires_grad_(), randn(64).requires_grad_(), randn(64).requires_grad_()
for name, fn in [("layer_norm", lambda impl: layer_norm(x, w, b, impl=impl)),
                 ("rms_norm", lambda impl: rms_norm(x, w, impl=impl))]:
    yt, yr = fn("triton"), fn("reference")
    gt = torch.autograd.grad(yt.square().sum(), (x, w))
    gr = torch.autograd.grad(yr.square().sum(), (x, w))
    rows.append((name, max_err(yt, yr), max(max_err(a, c) for a, c in zip(gt, gr))))

logits, targets = randn(16, 300).requires_grad_(), torch.randint(0, 300, (16,), generator=g)
lt = cross_entropy(logits, targets, impl="triton")
lr = cross_entropy(logits, targets, impl="reference")
rows.append(("cross_entropy", max_err(lt, lr),
             max_err(torch.autograd.grad(lt, logits)[0], torch.autograd.grad(lr, logits)[0])))

state = [randn(1000) for _ in range(2)] + [torch.zeros(1000), torch.zeros(1000)]
p_t, p_r = state[0].clone(), state[0].clone()
m_t, v_t, m_r, v_r = (torch.zeros(1000) for _ in range(4))
for step in (1, 2, 3):
    adamw_flat_(p_t, state[1], m_t, v_t, step=step, lr=1e-2, impl="triton")
    adamw_flat_(p_r, state[1], m_r, v_r, step=step, lr=1e-2, impl="reference")
rows.append(("adamw_flat_ (3 steps)", max_err(p_t, p_r), "-"))

w8, scale = quantize_weight(randn(64, 32))
xq = randn(4, 64)
rows.append(("int8_matmul", max_err(int8_matmul(xq, w8, scale, impl="triton"),
                                    int8_matmul(xq, w8, scale, impl="reference")), "-"))
print(cfx._src.core.text.format_table(rows, ["kernel", "forward max |diff|", "backward max |diff|"]))

# %% [markdown]
# ## GPT-2 in int8 (weight-only)
# `cfx.quant.quantize(params, "int8")` replaces every large Linear weight by int8 values and a
# per-output-column fp32 scale (symmetric, LLM.int8()'s vector-wise scheme without the outlier
# split); `Linear.apply` then runs `int8_matmul`. Each quantised weight shrinks 4x (the tied
# embedding, which is also the LM head, stays fp32); the logits move a little and the next-token
# choices agree.

# %%
model = cfx.models.gpt2("tiny", vocab_size=512)
params = model.init(cfx.random.key(0))
qparams = cfx.quant.quantize(params, "int8")
tokens = torch.randint(0, 512, (2, 64), generator=g)
with torch.no_grad():
    logits = model.apply(params, tokens)
    qlogits = model.apply(qparams, tokens)


def nbytes(tree):  # int8 weights and their scales count as leaves
    return cfx.tree.tree_bytes(cfx._src.precision.quant.quantized_as_leaves(tree))


agree = (logits.argmax(-1) == qlogits.argmax(-1)).float().mean().item()
print(f"weights: {nbytes(params) / 2**20:.2f} MiB fp32 -> {nbytes(qparams) / 2**20:.2f} MiB int8+scales")
print(f"max |logit diff| {max_err(logits, qlogits):.4f}; argmax agreement {100 * agree:.1f}%")

fig, ax = plt.subplots(figsize=(4, 4))
ax.scatter(logits.flatten()[::50], qlogits.flatten()[::50], s=2)
ax.set_xlabel("fp32 logits")
ax.set_ylabel("int8 weight-only logits")
ax.set_title("GPT-2 tiny: int8 vs fp32")
plt.show()
