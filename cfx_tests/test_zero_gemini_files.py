"""``GeminiEngine`` streaming from files (``offload(..., nvme_dir=)``): chunks cut into slices, each
with its own optimizer state, gradients written to files once a chunk's is whole, the next chunk
read ahead, the engine built from ``init`` one leaf at a time -- the numbers stay stage 3's."""
import os

import pytest
import torch

import cfx
from cfx import P
from cfx import zero
from cfx_tests.test_zero import data, gathered_model, gpt2
from cfx_tests.test_zero_gemini import STEPS, functional, with_engine

SLICE = 4096  # bytes: chunks of this tiny model span several slices


def files_engine(model, tx, directory, *, micro=1, from_init=False):
    """``with_engine``'s loop over an NVMe engine with tiny slices (built from ``init`` or from params)."""
    def body(params, batches):
        placement = zero.offload(cfx.gemini.host(), nvme_dir=directory)
        if from_init:
            engine = zero.GeminiEngine.from_init(model, gpt2().init, cfx.random.key(0), tx, axis="data",
                                                 offload=placement, slice_bytes=SLICE)
        else:
            engine = zero.GeminiEngine(model, zero.shard_params(params, axis="data"), tx, axis="data",
                                       offload=placement, slice_bytes=SLICE)
        assert engine.tiers.n_slices > 1
        losses = []
        for t in batches:
            loss = 0.0
            for mb in t.chunk(micro):
                loss = loss + engine.backward(lambda p: model.loss(p, mb[:, :-1], mb[:, 1:]) / micro)
            engine.update()
            losses.append(loss.reshape(1))
        io = engine.io
        assert io["read_bytes"] > 0 and io["write_bytes"] > 0 and io["read_s"] > 0 and io["write_s"] > 0
        buffers = engine.tiers.buffers  # reads land in buffers used before (no fresh pages faulted in)
        assert buffers.reused > buffers.made > 0
        assert not engine.stores["host"].keys() or all(k[0] != "grad" for k in engine.stores["host"].keys())
        out = torch.cat(losses), zero.gather_params(engine.params(), axis="data"), engine.traffic["nvme->host"]
        engine.close()
        return out
    return body


@pytest.mark.timeout(120)
@pytest.mark.parametrize("from_init", [False, True])
def test_sliced_files_give_stage3_params_bit_for_bit(tmp_path, from_init):
    model, tx, batches = gathered_model(gpt2()), cfx.optim.adamw(1e-3), data(STEPS)
    params = gpt2().init(cfx.random.key(0))
    with cfx.Mesh({"data": 2}) as mesh:
        ref_losses, ref = cfx.device_get(cfx.shard_map(functional(model, tx), mesh=mesh, in_specs=(P(), P(None, "data")),
                                                       out_specs=(P("data"), P()))(params, batches))
        losses, got, read = cfx.device_get(cfx.shard_map(files_engine(model, tx, tmp_path / "nvme", from_init=from_init),
                                                         mesh=mesh, in_specs=(P(), P(None, "data")),
                                                         out_specs=(P("data"), P(), P()))(params, batches))
    assert torch.equal(losses, ref_losses)
    for a, b in zip(cfx.tree.leaves(got), cfx.tree.leaves(ref)):
        assert torch.equal(a, b)
    assert not os.path.exists(tmp_path / "nvme") or all(not os.listdir(tmp_path / "nvme" / d)
                                                        for d in os.listdir(tmp_path / "nvme"))


@pytest.mark.timeout(120)
def test_accumulated_and_clipped_gradients_through_files_match_memory(tmp_path):
    model, batches = gathered_model(gpt2()), data(2)
    params = gpt2().init(cfx.random.key(0))
    for tx in [cfx.optim.sgd(0.3, momentum=0.9),
               cfx.optim.chain(cfx.optim.clip_by_global_norm(1e-3), cfx.optim.adamw(1e-3))]:
        with cfx.Mesh({"data": 2}) as mesh:
            ref_losses, ref, _ = cfx.device_get(cfx.shard_map(with_engine(model, tx, zero.offload(cfx.gemini.device()), micro=2),
                                                              mesh=mesh, in_specs=(P(), P(None, "data")),
                                                              out_specs=(P("data"), P(), P()))(params, batches))
            losses, got, _ = cfx.device_get(cfx.shard_map(files_engine(model, tx, tmp_path / "nvme", micro=2), mesh=mesh,
                                                          in_specs=(P(), P(None, "data")),
                                                          out_specs=(P("data"), P(), P()))(params, batches))
        torch.testing.assert_close(losses, ref_losses)
        cfx.tree.assert_tree_close(got, ref)


@pytest.mark.timeout(120)
def test_a_corrupted_state_file_stops_the_next_step(tmp_path):
    """Checksums are taken and checked off the I/O thread (by the thread that waits for the bytes):
    a flipped bit in a param file still raises ``ChecksumMismatch`` rather than training on it."""
    model, tx, batches = gathered_model(gpt2()), cfx.optim.adamw(1e-3), data(2)

    def body(batches):
        engine = zero.GeminiEngine.from_init(model, gpt2().init, cfx.random.key(0), tx, axis="data",
                                             offload=zero.offload(cfx.gemini.host(), nvme_dir=tmp_path / "nvme"),
                                             slice_bytes=SLICE)
        try:
            t = batches[0]
            engine.step(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))
            store = engine.stores["nvme"]
            path = store._path(("param", 0, 0))
            with open(path, "r+b") as f:
                f.seek(5)
                byte = f.read(1)
                f.seek(5)
                f.write(bytes([byte[0] ^ 0x10]))
            with pytest.raises(cfx.gemini.ChecksumMismatch, match=r"\('param', 0, 0\).*corrupted"):
                engine.step(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))
        finally:
            engine.close()
        return torch.zeros(1)
    with cfx.Mesh({"data": 1}) as mesh:
        cfx.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P())(batches)
