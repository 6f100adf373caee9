"""Overhead of cfx's functional style: one GPT-2 train step vs the same math as an eager Module.

Both run in one process on the same weights and batch, in interleaved rounds (alternating order),
and the ratio of median step times is reported (target <= 1.05). Also reported: the tokens/s of
``python -m cfx.train`` on its default settings (a shortened run under ``--quick``).
"""
from __future__ import annotations

import torch

import cfx
from cfx import models, optim
from cfx.bench.common import Row, interleaved_medians, report
from cfx.bench.torch_gpt2 import TorchGPT2
from cfx._src.train.config import TrainConfig
from cfx._src.train.loop import train


def step_pair(preset: str, batch: int, seq: int, seed: int = 0):
    """Two zero-argument train steps (cfx, torch) over identical weights, data and AdamW."""
    model = models.gpt2(preset)
    params = model.init(cfx.random.key(seed))
    k = cfx.random.split(cfx.random.key(seed + 1), 2)
    tokens = cfx.random.randint(k[0], (batch, seq), 0, model.config.vocab_size)
    targets = cfx.random.randint(k[1], (batch, seq), 0, model.config.vocab_size)
    hp = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)

    tx = optim.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"])
    loss_and_grad = cfx.value_and_grad(lambda p: model.loss(p, tokens, targets))
    state = {"params": params, "opt": tx.init(params), "loss": None}

    def cfx_step():
        loss, grads = loss_and_grad(state["params"])
        updates, state["opt"] = tx.update(grads, state["opt"], state["params"])
        state["params"] = optim.apply_updates(state["params"], updates)
        state["loss"] = float(loss.detach())

    module = TorchGPT2(model.config).load_cfx(params)
    opt = torch.optim.AdamW(module.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"])
    tstate = {"loss": None}

    def torch_step():
        opt.zero_grad(set_to_none=True)
        loss = module(tokens, targets)
        loss.backward()
        opt.step()
        tstate["loss"] = float(loss.detach())

    return cfx_step, torch_step, state, tstate


def run(*, quick: bool = False, json_path: str | None = None) -> dict:
    batch, seq, rounds = (1, 64, 4) if quick else (4, 256, 12)
    cfx_step, torch_step, cs, ts = step_pair("small", batch, seq)
    cfx_step(), torch_step()
    first_diff = abs(cs["loss"] - ts["loss"])  # same weights and batch: the first losses must agree
    t_cfx, t_torch = interleaved_medians([cfx_step, torch_step], rounds=rounds, warmup=0)
    ratio = t_cfx / t_torch
    steps = 40 if quick else TrainConfig().steps
    summary = train(TrainConfig(steps=steps, eval_every=0, progress=False))
    rows = [
        Row(f"gpt2-small train step time ratio cfx/torch (B={batch}, T={seq})", ratio, "x", "<= 1.05", ratio <= 1.05),
        Row("gpt2-small step time, cfx (median)", t_cfx, "s"),
        Row("gpt2-small step time, torch.nn.Module + torch.optim.AdamW (median)", t_torch, "s"),
        Row("first-step loss |cfx - torch|", first_diff, "nats", "<= 1e-4", first_diff <= 1e-4),
        Row(f"python -m cfx.train defaults ({steps} steps) tokens/s", summary["tokens_per_s"], "tok/s"),
        Row("python -m cfx.train eval loss first -> last", summary["eval_loss_last"], "nats",
            f"< {summary['eval_loss_first']:.3f}", summary["eval_loss_last"] < summary["eval_loss_first"]),
    ]
    return report("overhead", rows, json_path)
