"""A ``LoraModel``'s frozen base placed as a Plan keeps its state (``cfx._src.plan.frozen``, ``place_base``; the
program's ``TrainState.frozen``): the frozen base
sharded like ZeRO-3's params, each rank holding ``1/n`` of it (one shard per dtype: an int8 base's ``q`` s and
its fp32 scales and norms), every block's gathered just before it runs, freed after and re-gathered in
backward through ZeRO-3's own mechanism, without gradients. Over an int8 base, three AdamW steps under
``data=2 zero=3`` (with remat, with offload=host's adapters and host shards, with offload=nvme's shards in
files, with offload=auto) and ``data=2,model=2 zero=3`` equal one device's hand-written loop within
``assert_close``'s fp32 defaults, as in test_lora_model; each rank keeps half the base (a quarter-ish under
model=2: its Megatron block, halved), and the gathered bytes at the peak of a step do not grow with the
depth (measured: 26,880 bytes on rank 0 at 2 and at 4 blocks, while the base held per rank goes from
14,144 to 22,976 bytes, half of 28,288 and 45,952). Under ``pipe=2,data=2`` (and with ``zero=3``) each
stage keeps only its own blocks' base (half of the blocks', a quarter with ZeRO-3), the embedding's on the
first stage and the head's on the last, trains as one device does and still runs the whole model on
every rank (the logits of one device)."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx._src.plan.frozen import Placer, frozen_bytes, shard_base
from cfx.lora import lora_model, place_base
from cfx_tests.test_lora_model import V, _run, batches, int8_base, llama
from cfx_tests.test_plan_own_model import one_device

CONFIG = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"))


def _adapters(model):
    return cfx.tree.map(lambda t: t + 0.01, cfx.lora.init(model, CONFIG, cfx.random.key(1)))  # B != 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text", ["data=2 zero=3", "data=2 zero=3 remat=blocks offload=host", "data=2,model=2 zero=3",
                                  "data=2 zero=3 offload=nvme", "data=2 zero=3 offload=auto:1MiB"])
def test_a_sharded_int8_base_trains_as_on_one_device_holding_a_share_per_rank(text, tmp_path):
    model = llama()
    base = int8_base(model)
    before = cfx.tree.map(lambda t: t.clone(), base)
    adapters = _adapters(model)
    tx = cfx.optim.adamw(1e-2)
    whole = lora_model(model, CONFIG, base).base_bytes(0)
    held, placed = [], []

    def shard(lm, plan, mesh):
        placed.append(place_base(lm, plan, mesh, nvme_dir=str(tmp_path)))
        held.extend(placed[0].base_bytes(r) for r in mesh.local_ranks)
        return placed[0]
    got = _run(text, lora_model(model, CONFIG, base), adapters, tx, prepare=shard)

    def hand_written(ad, x, y):
        return model.loss(cfx.lora.attach(base, ad, CONFIG), x, y)
    cfx.tree.assert_close(got, one_device(hand_written, adapters, batches(), tx))
    assert not cfx.tree.allclose(got, adapters)  # they trained
    assert all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(base), cfx.tree.leaves(before)))
    assert len(set(held)) == 1
    if "model=" in text:  # each rank's Megatron block (norms whole on every rank), halved over data
        assert whole / 4 < held[0] < whole / 2 * 0.6
    else:  # half of it, up to ZeRO's padding of each leaf to a multiple of 2 elements
        assert whole / 2 <= held[0] <= whole / 2 * 1.01
    if "nvme" in text:  # after the steps every shard of the base is still a file's mapping, none a RAM tensor
        homes = [placed[0].base, *(b.base for b in placed[0].blocks)]
        files = {s.untyped_storage().filename for h in homes for shards in h.shards.values() for s in shards}
        assert files and all(f is not None and f.startswith(str(tmp_path)) for f in files), files


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text, share, explicit", [("pipe=2,data=2", 1 / 2, True), ("pipe=2,data=2 zero=3", 1 / 4, False)])
def test_under_pipe_each_stage_keeps_only_its_own_blocks_base(text, share, explicit):
    """``place_base`` under a pipe axis: each rank holds the base of the blocks its stage runs (halved
    again over data with ZeRO-3), the embedding's on the first stage and the head's on the last; the
    adapters train as on one device, and the whole model still runs on every rank (as ``Program.sample``
    runs it), each stage's base shared over ``pipe`` for it. ``plan.step`` places an unplaced base
    itself (``explicit=False``), and leaves a placed one as it is."""
    model = llama()
    base = int8_base(model)
    adapters, tx = _adapters(model), cfx.optim.adamw(1e-2)
    lm = lora_model(model, CONFIG, base)
    plan = cfx.parallel.Plan.parse(text)
    x, _ = batches()[0]
    with plan.make_mesh() as mesh:
        placed = place_base(lm, plan, mesh) if explicit else lm
        step = plan.step(placed, tx, mesh=mesh)
        assert step.model is placed if explicit else step.model.base_placed
        placed = step.model
        state = step.init_from(adapters)
        for b in batches():
            state, _ = step(state, b)
        got = step.params(state)
        assert state.frozen["top"] is placed.base  # the state holds the placed trees the blocks gather from
        assert [frozen_bytes(state.frozen, r) for r in mesh.local_ranks] == [placed.base_bytes(r)
                                                                            for r in mesh.local_ranks]
        every_rank = cfx.shard_map(lambda ad: placed.apply(ad, x), mesh=mesh, in_specs=(cfx.P(),), out_specs=cfx.P())
        logits = every_rank(got).gather()
        stage = {r: mesh.coords(r)["pipe"] for r in mesh.local_ranks}
    whole = lm.base_bytes(0, blocks_only=True)
    for r, pipe in stage.items():
        assert whole * share <= placed.base_bytes(r, blocks_only=True) <= whole * share * 1.01
        assert (placed.base.first.nbytes(r) > 0, placed.base.last.nbytes(r) > 0) == (pipe == 0, pipe == 1)

    def hand_written(ad, x, y):
        return model.loss(cfx.lora.attach(base, ad, CONFIG), x, y)
    cfx.tree.assert_close(got, one_device(hand_written, adapters, batches(), tx))
    torch.testing.assert_close(logits, model.apply(cfx.lora.attach(base, got, CONFIG), x))


def _gathered_peak(n_layer: int) -> tuple[int, int]:
    """(base bytes rank 0 holds, its peak gathered bytes over one data=2 zero=3 step)."""
    model = cfx.models.llama("tiny", n_layer=n_layer, vocab_size=V, hidden_size=32, n_head=4, n_kv_heads=2,
                             intermediate_size=48, max_position_embeddings=16)
    plan = cfx.parallel.Plan.parse("data=2 zero=3")
    with plan.make_mesh() as mesh:
        lm = shard_base(lora_model(model, CONFIG, int8_base(model)), mesh)
        step = plan.step(lm, cfx.optim.adamw(1e-2), mesh=mesh)
        state = step.init_from(_adapters(model))
        with cfx.memory.track() as mem:
            step(state, batches()[0])
        return lm.base_bytes(0), mem.peak_by_kind("device", rank=0)["gathered"]


@pytest.mark.timeout(120)
def test_a_step_gathers_one_block_of_the_base_at_a_time():
    held2, peak2 = _gathered_peak(2)
    held4, peak4 = _gathered_peak(4)
    assert held4 > 1.5 * held2  # twice the blocks held (as shards) ...
    assert peak4 == peak2       # ... but gathered one at a time, in forward and in backward


def test_what_placing_the_base_refuses():
    model = llama()
    lm = lora_model(model, CONFIG, model.init(cfx.random.key(0)))
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        with pytest.raises(ValueError, match="no such axis"):
            shard_base(lm, mesh, axis="seq")
        with pytest.raises(ValueError, match=r"stages must list, for each of the 0 ranks of the mesh's 'pipe' axis"):
            shard_base(lm, mesh, stages=[[0, 1]])
        with pytest.raises(ValueError, match="offload=nvme keeps the frozen weights in files"):
            place_base(lm, cfx.parallel.Plan.parse("data=2,model=2 zero=3 offload=nvme"), mesh)
        sharded = shard_base(lm, mesh)
        assert shard_base(sharded, mesh) is sharded  # placed already: as it is
        with pytest.raises(ValueError, match="place the frozen base once"):
            sharded.place_frozen(Placer(mesh, axis="data"))
        x, y = batches()[0]
        with pytest.raises(ValueError, match="model axis"):  # split by the Plan only
            sharded.loss(sharded.init(cfx.random.key(1)), x, y)
