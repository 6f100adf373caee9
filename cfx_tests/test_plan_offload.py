"""A Plan's offload (Gemini placement of ZeRO-3 pieces): the same numbers as without it, bit for
bit, on every axis; params, grads and optimizer state on the host; ``auto`` keeps the device under
its budget and moves fewer chunks than ``host``; a budget below one chunk fails before any rank."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import cfx
from cfx.parallel import Plan
from cfx_tests.test_plan import MODELS, data

STEPS = 3


def run(text, model, *, track=False):
    plan = Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state, losses = step.init(cfx.random.key(0)), []
        with cfx.memory.track(ops=track) as mem:
            for batch in data(STEPS):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
        return losses, step.params(state), mem, step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, text, offload", [
    ("gpt2", "data=2 zero=3", "offload=host"),
    ("llama", "data=2,model=2 zero=3 precision=bf16", "offload=auto:1MiB"),
    ("gpt2", "pipe=2,data=2 zero=3 microbatches=2", "offload=host"),
    ("gpt2", "data=2,model=2 zero=3", "offload=nvme"),
    ("llama", "data=2,pipe=1 zero=3 schedule=interleaved chunks=2", "offload=host"),  # stages share a rank
    ("gpt2", "pipe=2,data=2,model=2 zero=3 schedule=zb-h1 microbatches=2 remat=blocks", "offload=auto:2MiB"),
])
def test_offload_moves_bytes_not_numbers(name, text, offload):
    losses, params, _, _ = run(text, MODELS[name])
    got, got_params, mem, step = run(f"{text} {offload}", MODELS[name])
    assert got == losses
    for a, b in zip(cfx.tree.leaves(got_params), cfx.tree.leaves(params)):
        assert torch.equal(a, b)
    for rank in range(step.mesh.size):  # the model state lives on the host
        on_device = mem.peak_by_kind("device", rank=rank)
        assert not {"param", "grad", "optim"} & set(on_device), on_device
        assert on_device["chunk"] > 0 and on_device["gathered"] > 0
        home = mem.peak_by_kind("nvme" if "nvme" in offload else "host", rank=rank)
        assert home["param"] > 0 and home["optim"] > 0
        assert mem.peak_by_kind("host", rank=rank)["grad"] > 0


@pytest.mark.timeout(120)
def test_nvme_keeps_the_state_in_files_across_steps(tmp_path):
    plan = Plan.parse("data=2 zero=3 offload=nvme")
    with plan.make_mesh() as mesh:
        step = plan.step(MODELS["gpt2"], cfx.optim.adamw(1e-3), mesh=mesh, nvme_dir=tmp_path)
        state = step.init(cfx.random.key(0))

        def storages(state):
            return [b.untyped_storage() for a in cfx.tree.leaves(state) for b in a.blocks.values()]
        before = [s.data_ptr() for s in storages(state)]
        assert all(s.filename.startswith(str(tmp_path)) for s in storages(state))
        for batch in data(2):
            state, _ = step(state, batch)
        assert [s.data_ptr() for s in storages(state)] == before  # written in place: still the files
        assert step.placement_of(0).traffic["nvme->device"] > 0
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left behind


def test_the_default_nvme_directory_goes_with_its_program():
    plan = Plan.parse("data=2 zero=3 offload=nvme")
    with plan.make_mesh() as mesh:
        step = plan.step(MODELS["gpt2"], cfx.optim.adamw(1e-3), mesh=mesh)
        made = step.nvme_dir
        assert os.path.isdir(made) and os.path.basename(made).startswith("cfx-nvme-")
        del step
        gc.collect()
    assert not os.path.exists(made)


def test_an_unwritable_nvme_dir_is_refused_before_any_rank_runs(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    plan = Plan.parse("data=2 zero=3 offload=nvme")
    with plan.make_mesh() as mesh:
        with pytest.raises(ValueError, match="not writable"):
            plan.step(MODELS["gpt2"], cfx.optim.adamw(1e-3), mesh=mesh, nvme_dir=blocked / "sub")


@pytest.mark.timeout(300)
def test_auto_keeps_the_device_under_its_budget_and_moves_fewer_chunks_than_host():
    model, text = MODELS["gpt2"], "data=2 zero=3"
    _, _, _, host = run(f"{text} offload=host", model)
    # the warm-up record of a roomy budget places one between "a chunk at a time" and "all of them"
    _, _, _, roomy = run(f"{text} offload=auto:64MiB", model)
    placement = roomy.placement_of(0)
    rec = placement.placer.record
    least = max(rec.chunk_bytes[a[0]] + nm for a, nm in zip(rec.accesses, rec.non_model_bytes))
    most = max(rec.non_model_bytes) + sum(rec.chunk_bytes)
    budget = (least + most) // 2
    assert least < budget < most
    losses, params, mem, tight = run(f"{text} offload=auto:{budget}", model, track=True)
    for rank in range(tight.mesh.size):
        assert 0 < mem.peak("device", rank=rank) <= budget, (rank, mem.peak("device", rank=rank), budget)
    moved = {name: p.placement_of(0).traffic["host->device"] for name, p in
             [("host", host), ("roomy", roomy), ("tight", tight)]}
    chunks = sum(rec.chunk_bytes)
    assert moved["roomy"] < moved["tight"] < moved["host"], moved
    # after the warm-up (moved like host) a roomy budget fetches each chunk once per step
    assert moved["roomy"] == moved["host"] // STEPS + (STEPS - 1) * chunks, moved
    ref_losses, ref_params, _, _ = run(text, model)
    assert losses == ref_losses
    cfx.tree.assert_tree_close(params, ref_params, rtol=0, atol=0)


def test_a_budget_below_one_chunk_is_refused_before_any_rank_runs():
    plan = Plan.parse("pipe=2,data=2 zero=3 offload=auto:4KiB microbatches=2")
    with plan.make_mesh() as mesh:
        with pytest.raises(ValueError, match=r"offload=auto needs at least \d+ bytes .*budget is 4096 bytes"):
            plan.step(MODELS["gpt2"], cfx.optim.adamw(1e-3), mesh=mesh)


def test_describe_puts_the_offloaded_state_on_the_host():
    model = MODELS["gpt2"]
    plain = Plan.parse("data=2 zero=3").describe(model)
    off = Plan.parse("data=2 zero=3 offload=host").describe(model)
    assert off.model_state == plain.model_state
    assert off.tiers["params"] == off.tiers["grads"] == off.tiers["optimizer"] == "host"
    assert plain.tiers["params"] == "device"
    assert 0 < off.bytes["device chunks"] < off.bytes["params"]
    assert "host" in str(off)
