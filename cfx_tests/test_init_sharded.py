"""eval_shape allocates nothing; init_sharded equals device_put(init) bit for bit and never holds the
model: under an address-space cap that a full fp32 copy would exceed, each process builds its blocks."""
import datetime
import os
import resource
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx._src.parallel.megatron import MEGATRON_RULES

pytestmark = pytest.mark.timeout(180)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def test_eval_shape_gives_shapes_without_allocating():
    model = cfx.models.gpt2("small")  # 124M parameters: 500 MB if it were built
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS (VmHWM)
    before = _status("VmRSS")
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    assert _status("VmHWM") - before < 100 << 20  # nothing near 500 MB was ever resident
    assert all(isinstance(s, cfx.ShapeDtype) for s in cfx.tree.leaves(shapes))
    assert cfx.tree.tree_size(shapes) == 124_439_808
    assert shapes["wte"]["w"] == cfx.ShapeDtype((50257, 768), torch.float32)
    small = cfx.models.llama("tiny", vocab_size=64)
    got = cfx.eval_shape(small.init, cfx.random.key(1))
    real = small.init(cfx.random.key(1))
    assert [(s.shape, s.dtype) for s in cfx.tree.leaves(got)] == [(tuple(x.shape), x.dtype) for x in cfx.tree.leaves(real)]
    # ShapeDtype arguments stand for tensors
    out = cfx.eval_shape(lambda x, w: x @ w, cfx.ShapeDtype((3, 5), torch.float32), torch.zeros(5, 2))
    assert out == cfx.ShapeDtype((3, 2), torch.float32)


@given(cfx.testing.meshes(max_ranks=4, names=("data", "model")).filter(lambda m: 3 not in m.values()),
       st.sampled_from(["gpt2", "llama"]), st.integers(0, 9))
def test_blocks_equal_device_put_of_init_bitwise(mesh_shape, name, seed):
    model = (cfx.models.gpt2 if name == "gpt2" else cfx.models.llama)("tiny", vocab_size=64, n_layer=1)
    rules = {"embed": "data", **(MEGATRON_RULES if "model" in mesh_shape else {})}
    with cfx.Mesh(mesh_shape) as mesh:
        specs = cfx.Rules(rules).specs(model.axes(), mesh=mesh)
        got = cfx.init_sharded(model.init, cfx.random.key(seed), mesh=mesh, specs=specs)
        want = model.init(cfx.random.key(seed))
        for (path, a), b, s in zip(cfx.tree.flatten_with_path(got)[0], cfx.tree.leaves(want),
                                   cfx.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            ref = cfx.device_put(b, mesh, s)
            assert a.spec == s and a.shape == tuple(b.shape), path
            for r in mesh.local_ranks:
                assert torch.equal(a.blocks[r], ref.blocks[r]), (path, r)


def test_bad_specs_and_global_rng_are_refused_before_anything_is_built():
    model = cfx.models.gpt2("tiny", vocab_size=64)
    with cfx.Mesh({"data": 3}) as mesh:
        with pytest.raises(ValueError, match=r"'wte.w'.*not divisible by 3.*Pad"):
            cfx.init_sharded(model.init, cfx.random.key(0), mesh=mesh,
                             specs={**cfx.tree.map(lambda _: P(), model.axes(), is_leaf=lambda x: isinstance(x, tuple)),
                                    "wte": {"w": P("data")}})
        with pytest.raises(ValueError, match="global RNG"):
            cfx.init_sharded(lambda k: {"w": torch.randn(100, 100)}, cfx.random.key(0), mesh=mesh)

        def zero_a_row(k):  # a write through a view would not reach the lazily-built tensor
            w = cfx.random.normal(k, (96, 100))
            w[1] = 0.0
            return {"w": w}
        with pytest.raises(ValueError, match="writes in place into a view.*out of place"):
            cfx.init_sharded(zero_a_row, cfx.random.key(0), mesh=mesh, specs=P("data"))


# -- a process per rank under an address-space cap ------------------------------------------------

BIG = dict(n_layer=12, n_embd=1024, n_head=8, vocab_size=256, n_positions=64)  # 151M params, 605 MB fp32
CAP = 450 << 20  # what each process may add to its address space: less than one full copy


def _capped_worker(rank, n, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    model = cfx.models.gpt2("tiny", **BIG)
    with cfx.Mesh({"data": n}, backend="dist") as mesh:
        specs = cfx.Rules({"embed": "data"}).specs(model.axes(), mesh=mesh)
        limit = _status("VmSize") + CAP
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        params = cfx.init_sharded(model.init, cfx.random.key(0), mesh=mesh, specs=specs)
        sums = torch.stack([b.sum() for x in cfx.tree.leaves(params) for b in x.blocks.values()])
        held = sum(x.addressable_nbytes for x in cfx.tree.leaves(params))
        del params
        try:  # the cap is real: a full copy does not fit
            model.init(cfx.random.key(0))
            full_fits = True
        except (MemoryError, RuntimeError):
            full_fits = False
    torch.save({"full_fits": full_fits, "sums": sums, "held": held}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_init_sharded_builds_a_model_larger_than_a_capped_process(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # the cap counts address space: no per-thread arenas
    n = 4
    model = cfx.models.gpt2("tiny", **BIG)
    full_bytes = cfx.tree.tree_bytes(cfx.eval_shape(model.init, cfx.random.key(0)))
    assert full_bytes > CAP
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        mp.start_processes(_capped_worker, args=(n, init_file, d), nprocs=n, start_method="spawn", join=True)
        got = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(n)]
    want = model.init(cfx.random.key(0))
    with cfx.Mesh({"data": n}) as mesh:  # the same blocks, from a full copy in this uncapped process
        specs = cfx.Rules({"embed": "data"}).specs(model.axes(), mesh=mesh)
        ref = [cfx.device_put(x, mesh, s) for x, s in zip(cfx.tree.leaves(want),
                                                          cfx.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' reduction order: equal blocks give equal sums, bit for bit
    try:
        want_sums = [torch.stack([a.blocks[r].sum() for a in ref]) for r in range(n)]
    finally:
        torch.set_num_threads(threads)
    for r in range(n):
        assert not got[r]["full_fits"], "the cap must be too small for model.init"
        torch.testing.assert_close(got[r]["sums"], want_sums[r], rtol=0, atol=0)
        assert got[r]["held"] < full_bytes * 0.3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_in_place_inits_and_a_reused_generator_replay_bit_for_bit():
    # torch.nn.init style: fill an empty tensor in place, draw twice from one generator
    def init(key):
        g = torch.Generator().manual_seed(7)  # (eval_shape runs this on a fake key: no key values)
        w = torch.empty(96, 80).normal_(generator=g)     # lazy (large), drawn in place
        w.mul_(0.02)
        v = torch.empty(64, 100).uniform_(-1, 1, generator=g)  # the same generator, advanced
        return {"w": w, "v": v + 1.0, "b": torch.zeros(8)}
    want = init(cfx.random.key(7))
    with cfx.Mesh({"data": 2}) as mesh:
        got = cfx.init_sharded(init, cfx.random.key(7), mesh=mesh, specs={"w": P("data"), "v": P(None, "data"),
                                                                           "b": P()})
        for k in want:
            assert torch.equal(cfx.device_get(got[k]), want[k]), k
