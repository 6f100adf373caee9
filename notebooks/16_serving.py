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
# # Serving many requests: the paged KV cache and continuous batching
#
# `cfx.serve.Engine` decodes many requests at once. Its KV cache is a pool of fixed-size blocks: a
# sequence holds only the blocks its tokens fill, and requests join and leave the batch between steps.
# `cfx.generate` instead runs one batch to its end, with a cache reserved for the longest prompt plus
# the longest output. This notebook runs the same requests both ways on a small GPT-2 (4 layers of
# width 256 and GPT-2's vocabulary, `python -m cfx.bench serve`'s model) and draws two things: how much
# of the reserved KV memory holds tokens, step by step, and the throughput at each batch size.

# %%
# %matplotlib inline
import time

import matplotlib.pyplot as plt
import torch

import cfx
from cfx.serve import Engine, SamplingParams

model = cfx.models.gpt2("small", n_layer=4, n_embd=256, n_head=4)  # GPT-2's vocabulary of 50,257: the bench's model
params = model.init(cfx.random.key(0))
g = torch.Generator().manual_seed(0)
requests = [(torch.randint(0, 50257, (int(torch.randint(8, 129, (), generator=g)),), generator=g).tolist(),
             int(torch.randint(4, 49, (), generator=g))) for _ in range(12)]  # (prompt ids, output length)
wanted = sum(n for _, n in requests)
print(f"{len(requests)} requests: prompts of {min(len(p) for p, _ in requests)}-{max(len(p) for p, _ in requests)} "
      f"tokens, {wanted} output tokens asked for")

# %% [markdown]
# ## KV memory over time
# Eight sequences at a time on both sides. The engine's curve is the share of token slots in the blocks
# its running sequences hold that hold a token (`engine.stats["occupancy"]`, one value a step). The padded
# cache of a static batch reserves `longest prompt + longest output` slots per row for the whole batch; a
# row's slots fill as it decodes, and the rows that finish early leave theirs empty.

# %%
def run_engine(max_seqs):
    """The engine (its pool made once, as a server makes it) over every request; its stepping's seconds."""
    engine = Engine(model, params, max_seqs=max_seqs, block_size=16)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in requests]
    held = []
    while engine.has_unfinished():
        engine.step()
        held.append(engine.blocks.held)
    return engine, [engine.output(i)[0] for i in ids], held, time.perf_counter() - t0


def padded_occupancy(batch):
    """Each decode step's share of a padded cache's slots holding a token, batch by batch."""
    curve = []
    for s in range(0, len(requests), batch):
        chunk = requests[s:s + batch]
        P, N = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
        for t in range(1, N + 1):
            curve.append(sum(len(p) + min(t, n) for p, n in chunk) / (len(chunk) * (P + N)))
    return curve


engine, outputs, held, _ = run_engine(8)
paged, padded = engine.stats["occupancy"], padded_occupancy(8)
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3))
ax.plot(paged, label=f"paged (engine): mean {sum(paged) / len(paged):.2f}")
ax.plot(padded, label=f"padded static batches: mean {sum(padded) / len(padded):.2f}")
ax.set_xlabel("step")
ax.set_ylabel("slots holding a token")
ax.set_ylim(0, 1.05)
ax.legend()
ax2.plot(held)
ax2.set_xlabel("step")
ax2.set_ylabel("KV blocks held (of 16 tokens)")
assert sum(paged) / len(paged) > 0.9 > sum(padded) / len(padded)

# %% [markdown]
# Every request's tokens are those `cfx.generate` gives it on its own (greedy):

# %%
same = [out == cfx.generate(model, params, torch.tensor([p]), max_new_tokens=n)[0, len(p):].tolist()
        for (p, n), out in zip(requests[:4], outputs[:4])]
assert all(same)
print("the first 4 requests: the same tokens as cfx.generate alone")

# %% [markdown]
# ## Throughput against batch size
# Output tokens asked for, per second. A static batch of `cfx.generate` left-pads its prompts and decodes
# until its longest request is done, so short requests wait on long ones; the engine refills a finished
# sequence's place at the next step. It pays for that with bookkeeping, about a millisecond of Python
# a step on a CPU: on a toy model whose steps cost less than that, `cfx.generate` wins; here a step
# costs several milliseconds (the head alone reads 51 MB of weights), and fewer steps win.

# %%
def static_seconds(batch):
    t0 = time.perf_counter()
    for s in range(0, len(requests), batch):
        chunk = requests[s:s + batch]
        P = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), P, dtype=torch.long)
        mask = torch.zeros(len(chunk), P, dtype=torch.bool)
        for b, (p, _) in enumerate(chunk):
            ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), True
        cfx.generate(model, params, ids, mask=mask, max_new_tokens=max(n for _, n in chunk))
    return time.perf_counter() - t0


sizes, engine_tps, static_tps = [2, 4, 8], [], []  # (1 would take as long as the rest together)
for batch in sizes:
    engine_tps.append(wanted / run_engine(batch)[-1])
    static_tps.append(wanted / static_seconds(batch))
fig, ax = plt.subplots(figsize=(5.5, 3))
ax.plot(sizes, engine_tps, "o-", label="cfx.serve.Engine")
ax.plot(sizes, static_tps, "s-", label="cfx.generate, padded batches")
ax.set_xscale("log", base=2)
ax.set_xlabel("sequences at a time")
ax.set_ylabel("output tokens / s")
ax.legend()
print({b: f"{e / s:.2f}x" for b, e, s in zip(sizes, engine_tps, static_tps)})
