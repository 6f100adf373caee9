"""Gemini placement for ZeRO-3: every policy gives stage 3's params bit for bit; ``auto`` keeps
the tracked device peak under its budget; bad budgets and NVMe directories fail early."""
import gc
import os

import pytest
import torch

import cfx
from cfx import P
from cfx import zero
from cfx_tests.test_zero import data, gathered_model, gpt2

STEPS = 3


def functional(model, tx):
    ztx = zero(tx, stage=3, axis="data")

    def body(params, batches):
        p = zero.shard_params(params, axis="data")
        state, losses = ztx.init(p), []
        for t in batches:
            loss, g = ztx.value_and_grad(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))(p)
            u, state = ztx.update(g, state, p)
            p = cfx.optim.apply_updates(p, u)
            losses.append(loss.reshape(1))
        return torch.cat(losses), zero.gather_params(p, axis="data")
    return body


def with_engine(model, tx, placement, *, micro=1, track=None, several_chunks=False):
    def body(params, batches):
        engine = zero.GeminiEngine(model, zero.shard_params(params, axis="data"), tx, axis="data",
                                   offload=placement)
        assert engine.chunks.n_chunks > 1 or not several_chunks  # the norm spans them
        losses = []
        for t in batches:
            loss = 0.0
            for mb in t.chunk(micro):
                if track is not None:
                    with track.track_ops("device"):
                        loss = loss + engine.backward(lambda p: model.loss(p, mb[:, :-1], mb[:, 1:]) / micro)
                else:
                    loss = loss + engine.backward(lambda p: model.loss(p, mb[:, :-1], mb[:, 1:]) / micro)
            engine.update()
            losses.append(loss.reshape(1))
        assert all(s is cfx.gemini.TensorState.FREE for s in engine.states.values())
        return torch.cat(losses), zero.gather_params(engine.params(), axis="data"), engine
    return body


@pytest.mark.timeout(120)
def test_every_policy_gives_stage3_params_bit_for_bit(tmp_path):
    model, tx, batches = gathered_model(gpt2()), cfx.optim.adamw(1e-3), data(STEPS)
    params = gpt2().init(cfx.random.key(0))
    placements = {"device": zero.offload(cfx.gemini.device()), "host": zero.offload(cfx.gemini.host()),
                  "auto": zero.offload(cfx.gemini.auto(1 << 30)),
                  "nvme": zero.offload(cfx.gemini.host(), nvme_dir=tmp_path / "nvme")}
    with cfx.Mesh({"data": 2}) as mesh:
        ref_losses, ref_params = cfx.device_get(cfx.shard_map(functional(model, tx), mesh=mesh, in_specs=(P(), P(None, "data")),
                                               out_specs=(P("data"), P()))(params, batches))
        for name, placement in placements.items():
            losses, got, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, placement), mesh=mesh,
                                           in_specs=(P(), P(None, "data")),
                                           out_specs=(P("data"), P(), P()))(params, batches))
            assert torch.equal(losses, ref_losses), name
            for a, b in zip(cfx.tree.leaves(got), cfx.tree.leaves(ref_params)):
                assert torch.equal(a, b), name
        assert os.listdir(tmp_path / "nvme")  # the NVMe run did write chunk files (its engine is alive)
        del _
        gc.collect()
    assert os.listdir(tmp_path / "nvme") == []  # engines collected: their files and directories gone


@pytest.mark.timeout(120)
def test_clipping_sees_every_chunk_of_every_rank():
    # a clip far below the gradient norm: each chunk's update depends on the whole model's norm
    model, batches = gathered_model(gpt2()), data(STEPS)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(1e-3), cfx.optim.adamw(1e-3))
    params = gpt2().init(cfx.random.key(0))
    with cfx.Mesh({"data": 2}) as mesh:
        ref_losses, ref_params = cfx.device_get(cfx.shard_map(functional(model, tx), mesh=mesh,
                                               in_specs=(P(), P(None, "data")), out_specs=(P("data"), P()))(params, batches))
        losses, got, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.host()), several_chunks=True),
                                       mesh=mesh, in_specs=(P(), P(None, "data")),
                                       out_specs=(P("data"), P(), P()))(params, batches))
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(got, ref_params)


@pytest.mark.timeout(120)
def test_auto_keeps_the_tracked_device_peak_under_the_budget():
    model, tx, batches = gathered_model(gpt2()), cfx.optim.adamw(1e-3), data(STEPS)
    params = gpt2().init(cfx.random.key(0))
    with cfx.Mesh({"data": 2}) as mesh:
        # measure the warm-up once to place the budget between "one layer at a time" and "all"
        _, _, eng = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.auto(1 << 30))), mesh=mesh,
                                  in_specs=(P(), P(None, "data")), out_specs=(P("data"), P(), P()))(params, data(1)))
        rec = eng.record
        least = max(rec.chunk_bytes[a[0]] + nm for a, nm in zip(rec.accesses, rec.non_model_bytes))
        most = max(rec.non_model_bytes) + sum(rec.chunk_bytes)
        budget = (least + most) // 2
        assert least < budget < most
        auto = zero.offload(cfx.gemini.auto(budget))
        with cfx.memory.track() as mem:
            _, params_auto, eng = cfx.device_get(cfx.shard_map(with_engine(model, tx, auto, track=mem), mesh=mesh,
                                                in_specs=(P(), P(None, "data")),
                                                out_specs=(P("data"), P(), P()))(params, batches))
        assert 0 < mem.peak("device") <= budget
        assert eng.traffic["host->device"] > STEPS * sum(rec.chunk_bytes)  # it did evict and re-fetch
        _, params_dev, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.device())), mesh=mesh,
                                         in_specs=(P(), P(None, "data")),
                                         out_specs=(P("data"), P(), P()))(params, batches))
    for a, b in zip(cfx.tree.leaves(params_auto), cfx.tree.leaves(params_dev)):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_gradient_accumulation_in_the_engine_matches_stage3():
    model, tx = gathered_model(gpt2()), cfx.optim.sgd(0.3, momentum=0.9)
    params, batches = gpt2().init(cfx.random.key(0)), data(2)
    with cfx.Mesh({"data": 2}) as mesh:
        _, ref, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.device())), mesh=mesh,
                                  in_specs=(P(), P(None, "data")), out_specs=(P("data"), P(), P()))(params, batches))
        _, got, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.host()), micro=2), mesh=mesh,
                                  in_specs=(P(), P(None, "data")), out_specs=(P("data"), P(), P()))(params, batches))
    cfx.tree.assert_tree_close(got, ref)


@pytest.mark.timeout(60)
def test_budget_below_one_layer_raises_on_every_rank_before_any_collective():
    model = gathered_model(gpt2())
    params = gpt2().init(cfx.random.key(0))

    def body(params):
        zp = zero.shard_params(params, axis="data")
        with cfx.comm_stats() as stats:
            try:
                zero.GeminiEngine(model, zp, cfx.optim.sgd(0.1), axis="data",
                                  offload=zero.offload(cfx.gemini.auto(10_000)))
            except ValueError as e:
                msg = str(e)
        ok = "needs at least" in msg and "bytes" in msg and "for chunk" in msg and not stats.records
        return torch.tensor([float(ok)])

    with cfx.Mesh({"data": 2}) as mesh:
        assert cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))(params)).tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match=r"needs at least \d+ bytes of device memory for chunk \d+ \(groups"):
            cfx.device_get(cfx.shard_map(lambda p: zero.GeminiEngine(model, zero.shard_params(p, axis="data"), cfx.optim.sgd(0.1),
                                                      axis="data", offload=zero.offload(cfx.gemini.auto(10_000))),
                          mesh=mesh, in_specs=P(), out_specs=P())(params))


def _waste(numels, size):
    chunks, used = 1, 0
    for n in numels:
        if used + n > size:
            chunks, used = chunks + 1, 0
        used += n
    return chunks * size - sum(numels)


@pytest.mark.timeout(60)
def test_chunk_size_is_the_least_waste_size_and_chunks_are_equal(tmp_path):
    model, params = gathered_model(gpt2()), gpt2().init(cfx.random.key(0))

    def body(params, max_chunk_size=None):
        eng = zero.GeminiEngine(model, zero.shard_params(params, axis="data"), cfx.optim.adamw(1e-3), axis="data",
                                offload=zero.offload(cfx.gemini.host(), nvme_dir=tmp_path), max_chunk_size=max_chunk_size)
        sizes = [lay.size for lay in eng.layouts]
        best = min(range(max(sizes), 2 * max(sizes) + 1), key=lambda s: (_waste(sizes, s), s))  # brute force
        search = eng.chunk_search
        assert (search.size, search.waste) == (best, _waste(sizes, best))
        assert search.n_chunks == len(eng.chunks.groups) > 1 and 0 <= search.waste_fraction < 1
        nvme = eng.stores["nvme"]  # params and optimizer state (moments; not the step count): one per chunk
        eng.tiers.io.drain()
        assert eng.tiers.n_slices == 1  # small chunks: one file each
        assert {nvme.get(("param", c, 0)).numel() for c in range(search.n_chunks)} == {search.size}
        assert {nvme.get(k).numel() for k in nvme.keys() if k[0] == "optim"} == {1, search.size}
        # execution order, no group split: each chunk holds consecutive groups, within its size
        assert [g for gs in eng.chunks.groups for g in gs] == list(range(len(sizes)))
        for gs in eng.chunks.groups:
            assert eng.chunks.offset[gs[0]] == 0 and sum(sizes[g] for g in gs) <= search.size
        one = zero.GeminiEngine(model, zero.shard_params(params, axis="data"), cfx.optim.sgd(0.1), axis="data",
                                offload=zero.offload(cfx.gemini.host()), max_chunk_size=max(sizes))
        assert one.chunk_search.size == max(sizes) and one.chunk_search.n_chunks == len(sizes)
        eng.close()
        return torch.ones(1)

    with cfx.Mesh({"data": 2}) as mesh:
        assert cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))(params)).tolist() == [1.0, 1.0]


def test_unwritable_nvme_dir_raises_before_training():
    with pytest.raises(ValueError, match="not writable"):
        zero.offload(cfx.gemini.host(), nvme_dir="/proc/cfx-no-such-dir/chunks")
    with pytest.raises(ValueError, match="policy must be"):
        zero.offload("auto")


@pytest.mark.timeout(60)
def test_per_leaf_norms_on_flat_chunks_are_refused():
    model, batches = gathered_model(gpt2()), data(1)
    params = gpt2().init(cfx.random.key(0))
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="per-leaf norms .* flat chunks.*cfx.parallel.Plan"):
            cfx.shard_map(with_engine(model, cfx.optim.lamb(1e-3), zero.offload(cfx.gemini.host())), mesh=mesh,
                          in_specs=(P(), P(None, "data")), out_specs=(P("data"), P(), P()))(params, batches)
