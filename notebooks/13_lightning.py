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
# # cfx inside PyTorch Lightning
#
# `cfx.lightning` runs a `cfx.parallel.Plan` as a Lightning strategy: the Trainer keeps its loop
# -- logging, validation, callbacks, checkpoints, the progress bar -- and each `training_step`
# runs one step of the plan's program (forward, backward and the optimizer's update; ZeRO,
# offload, remat, pipe and model axes as the plan says). Here GPT-2 tiny trains on the Python
# standard library's source under ZeRO-3 over two data-parallel ranks. With `devices=1` the two
# ranks are threads of this kernel; `devices=2` would start a process per rank.

# %%
# %matplotlib inline
import csv
import dataclasses
import os

import lightning.pytorch as pl
import matplotlib.pyplot as plt

import cfx
import cfx.lightning
from cfx.train import TrainConfig, train

cfg = TrainConfig(steps=30, batch=8, seq=64, warmup=5, eval_every=10, eval_batches=2, sample_bytes=0,
                  progress=False)
module = cfx.lightning.Module.from_config(cfg)  # python -m cfx.train's model, optimizer and keys
data = cfx.lightning.ByteData.from_config(cfg)  # ... and its batches, in its order

# %% [markdown]
# ## A fit under a Plan
# The plan is the strategy's argument (`Strategy("data=2", zero=3)` says the same); the precision
# would be the Trainer's flag (`precision="bf16-mixed"` is cfx's bf16 policy). `ModelCheckpoint`
# writes cfx's sharded checkpoints, each a directory with Lightning's own file beside it.

# %%
trainer = pl.Trainer(strategy=cfx.lightning.Strategy("data=2 zero=3"), devices=1, max_steps=cfg.steps,
                     val_check_interval=cfg.eval_every, num_sanity_val_steps=0, log_every_n_steps=1,
                     logger=pl.loggers.CSVLogger("logs", name="gpt2-tiny"), enable_model_summary=False,
                     callbacks=[pl.callbacks.ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10)])
trainer.fit(module, data)
print(cfx.parallel.Plan.parse("data=2 zero=3").describe(module.model, module.tx, batch=(cfg.batch, cfg.seq)))

# %% [markdown]
# ## The logged loss
# The CSV logger has a row per logged step: the training loss and learning rate every step, the
# validation loss every `val_check_interval` steps.

# %%
with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
train_loss = [(int(r["step"]) + 1, float(r["train_loss"])) for r in rows if r["train_loss"]]
val_loss = [(int(r["step"]) + 1, float(r["val_loss"])) for r in rows if r["val_loss"]]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(*zip(*train_loss), label="train")
ax.plot(*zip(*val_loss), "o-", label="validation")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats per byte)")
ax.legend()
assert len(train_loss) == cfg.steps and train_loss[-1][1] < train_loss[0][1] - 1.0

# %% [markdown]
# ## The same run as `python -m cfx.train`
# Same config, seed and plan: the same program on the same batches, so the losses agree to the
# bit (here the first five steps of `--mesh data=2 --zero 3`).

# %%
ref = train(dataclasses.replace(cfg, mesh="data=2", zero=3, stop_after=5))
assert [loss for _, loss in ref["history"]["train"]] == [loss for _, loss in train_loss[:5]]
print("losses of steps 1-5, both runs:", [round(loss, 4) for _, loss in train_loss[:5]])

# %% [markdown]
# ## Checkpoints
# Each checkpoint is cfx's sharded directory (every process writes its own regions; any plan,
# one device or `python -m cfx.train --resume DIR` reads it) plus `lightning.ckpt`, the loops'
# and callbacks' state; `trainer.fit(module, data, ckpt_path=DIR)` continues from it bitwise.

# %%
last = os.path.join("ckpt", sorted(os.listdir("ckpt"))[-1])
print(last, sorted(os.listdir(last)))
