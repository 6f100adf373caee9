"""Run by test_checkpoint_dcp under torchrun (2 processes, gloo): GPT-2 as Hugging Face's
``GPT2LMHeadModel`` under FSDP2 (``fully_shard`` on each block, then the root) with
``torch.optim.AdamW``, its checkpoints through torch's documented flow (``get_state_dict`` ->
``dcp.save``; ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``).

``save DIR OUT``: start from cfx's init of the model, train ``TRAINED`` steps, save DIR, continue
``CONTINUED`` steps; then cfx (the plan ``data=2 zero=3`` on the ``dist`` backend, in the same
processes) loads DIR and continues alike. ``load DIR OUT START``: a fresh model (torch's own init)
and optimizer load DIR and continue ``CONTINUED`` steps from step START. Each step's batch is
``batch(step)``, rank r taking its half of the rows; process 0 writes the losses (the mean over
both halves) to OUT as JSON, ``{"fsdp2": [...], "cfx": [...]}``.

The constants are the test's too: the cfx side runs the same model, optimizer and batches.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cfx
from cfx.bench.common import end_worker

CONFIG = dict(n_layer=2, vocab_size=64, n_embd=32, n_head=4, n_positions=16)
LR, WEIGHT_DECAY = 1e-2, 0.1
ROWS = 4
TRAINED, CONTINUED = 2, 5


def model():
    return cfx.models.gpt2("tiny", **CONFIG)


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: tokens ``(ROWS, T + 1)``."""
    T = CONFIG["n_positions"]
    return cfx.random.randint(cfx.random.fold_in(cfx.random.key(1), step), (ROWS, T + 1), 0, CONFIG["vocab_size"])


def fsdp2(start_from_cfx: bool):
    """``(module, optimizer)``: GPT2LMHeadModel sharded by FSDP2 over the world, AdamW over it."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(dist.get_rank() + 5)  # a fresh model: another init than the checkpoint's
    m = transformers.GPT2LMHeadModel(model().hf_config())
    if start_from_cfx:
        m.load_state_dict(cfx.models.to_hf(model(), model().init(cfx.random.key(0))))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in m.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def train(m, opt, steps: range) -> list[float]:
    losses = []
    for s in steps:
        tokens = batch(s).chunk(dist.get_world_size())[dist.get_rank()]
        logits = m(input_ids=tokens[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def cfx_continues(directory: str, plan: str, start: int) -> list[float]:
    """The losses of ``plan`` continuing from the DCP ``directory`` for ``CONTINUED`` steps."""
    from cfx.parallel import Plan

    tx = cfx.optim.adamw(LR, weight_decay=WEIGHT_DECAY)
    plan = Plan.parse(plan)
    with plan.make_mesh() as mesh:
        program = plan.step(model(), tx, mesh=mesh)
        state, _ = program.load(cfx.checkpoint.from_dcp(directory, model(), tx), program.init(cfx.random.key(3)))
        losses = []
        for s in range(start, start + CONTINUED):
            tokens = batch(s)
            state, metrics = program(state, (tokens[:, :-1], tokens[:, 1:]))
            losses.append(float(cfx.device_get(metrics["loss"])))
    return losses


def main(mode: str, directory: str, out: str, start: int = 0) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    m, opt = fsdp2(start_from_cfx=mode == "save")
    if mode == "save":
        train(m, opt, range(TRAINED))
        model_sd, optim_sd = get_state_dict(m, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)
        start = TRAINED
    else:
        model_sd, optim_sd = get_state_dict(m, opt)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    losses = {"fsdp2": train(m, opt, range(start, start + CONTINUED))}
    if mode == "save":  # and cfx in these processes (the dist backend), ZeRO-3 over both
        losses["cfx"] = cfx_continues(directory, "data=2 zero=3", start)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()
    end_worker()  # no interpreter finalization: it races gloo's threads (an abort in ~1 exit of 10)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
