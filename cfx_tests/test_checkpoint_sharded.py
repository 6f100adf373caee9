"""Sharded checkpoints: saved on one mesh, loaded bitwise on another (or whole); a save killed before
its commit leaves the previous checkpoint loadable; damaged or mismatched checkpoints are clear
errors; a load holds a process's own blocks plus one slice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx_tests.budget import examples

SAVED_ON = {"data": 4}


def state():
    """A training-state-like tree: split, replicated and plain leaves."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g),
            "moments": [torch.randn(8, 16, generator=g), torch.randn(4, 4, 4, generator=g).to(torch.bfloat16)],
            "step": torch.tensor(7)}


SAVE_SPECS = {"w": P("data"), "b": P(), "moments": [P(None, "data"), P(None, None, "data")], "step": P()}


def save_sharded(directory, tree=None, metadata=None):
    tree = state() if tree is None else tree
    with cfx.Mesh(SAVED_ON) as mesh:
        arrays = cfx.shard_map(lambda t: t, mesh=mesh, in_specs=(SAVE_SPECS,), out_specs=SAVE_SPECS)(tree)
        cfx.checkpoint.save(directory, arrays, metadata=metadata)
    return tree


def like():
    return cfx.eval_shape(state)


def dims_split(shape, mesh_shape):
    """Specs for ``shape`` over ``mesh_shape``'s axes: each axis on at most one dimension it divides."""
    @st.composite
    def draw(draw):
        entries = [[] for _ in shape]
        for axis, n in mesh_shape.items():
            fits = [d for d, size in enumerate(shape)
                    if size % (n * max(1, _prod(mesh_shape[a] for a in entries[d]))) == 0]
            d = draw(st.sampled_from([None] + fits))
            if d is not None:
                entries[d].append(axis)
        return P(*[tuple(e) if len(e) > 1 else (e[0] if e else None) for e in entries])
    return draw()


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@pytest.mark.timeout(120)
@examples(ci=6)
@given(data=st.data())
def test_saved_on_one_mesh_loads_bitwise_on_another(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("ckpt")
    want = save_sharded(directory, metadata={"step": 7})
    mesh_shape = data.draw(st.sampled_from([{"data": 2, "model": 2}, {"pipe": 2, "data": 2}, {"data": 4},
                                            {"model": 8}, {"seq": 1}]), label="mesh")
    shapes = cfx.tree.leaves(like())
    specs = [data.draw(dims_split(x.shape, mesh_shape), label="spec") for x in shapes]
    spec_tree = cfx.tree.unflatten(cfx.tree.structure(like()), specs)
    with cfx.Mesh(mesh_shape) as mesh:
        got, meta = cfx.checkpoint.load(directory, like(), mesh=mesh, specs=spec_tree)
        assert all(a.mesh is mesh and a.spec == s for a, s in zip(cfx.tree.leaves(got), specs))
        got = cfx.device_get(got)
    assert meta == {"step": 7}
    for a, b in zip(cfx.tree.leaves(got), cfx.tree.leaves(want)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_loads_as_whole_tensors_on_one_device(tmp_path):
    want = save_sharded(tmp_path)
    got, _ = cfx.checkpoint.load(tmp_path, like())
    for a, b in zip(cfx.tree.leaves(got), cfx.tree.leaves(want)):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_a_load_holds_its_own_blocks_and_one_slice(tmp_path):
    tree = {"w": torch.randn(64, 256)}  # saved as 4 row blocks; loaded as 8 column blocks
    with cfx.Mesh({"data": 4}) as mesh:
        cfx.checkpoint.save(tmp_path, {"w": cfx.device_put(tree["w"], mesh, P("data"))})
    with cfx.Mesh({"model": 8}) as mesh, cfx.memory.track() as mem:
        got, _ = cfx.checkpoint.load(tmp_path, cfx.eval_shape(lambda: tree), mesh=mesh, specs=P(None, "model"))
        own = sum(b.numel() * 4 for b in got["w"].blocks.values())
        # one slice at a time: safetensors reads the rows it needs whole (the 16 rows of a stored block)
        # and cuts the columns in memory
        slice_bytes = 16 * 256 * 4
        assert mem.peak("host") <= own + slice_bytes, (mem.peak("host"), own, slice_bytes)
        assert mem.peak("host") >= own
    assert torch.equal(cfx.device_get(got)["w"], tree["w"])


def test_a_second_save_replaces_the_first_and_removes_its_files(tmp_path):
    save_sharded(tmp_path)
    first = set(os.listdir(tmp_path))
    newer = cfx.tree.map(lambda x: x + 1, state())
    save_sharded(tmp_path, newer)
    assert not (first - {"index.json"}) & set(os.listdir(tmp_path))  # the old generation's shards are gone
    got, _ = cfx.checkpoint.load(tmp_path, like())
    assert torch.equal(got["w"], newer["w"])


KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    import safetensors.torch
    import cfx
    from cfx._src.checkpoint import sharded as checkpoint_sharded
    from cfx_tests.test_checkpoint_sharded import save_sharded, state
    def half_then_die(tensors, path, metadata=None):  # killed half way through writing a shard
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "mid-write":
        safetensors.torch.save_file = half_then_die
    else:  # every shard written, no commit
        checkpoint_sharded._barrier = lambda: os.kill(os.getpid(), signal.SIGKILL)
    save_sharded(sys.argv[1], cfx.tree.map(lambda x: x * 0, state()))
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["mid-write", "before-commit"])
def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(tmp_path, when):
    want = save_sharded(tmp_path)
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), when],
                          cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    left = os.listdir(tmp_path)  # what the dead save left: its shards, or a half-written temporary file
    assert any(n.startswith("g000002") for n in left) if when == "before-commit" else any(".tmp-" in n for n in left)
    got, _ = cfx.checkpoint.load(tmp_path, like())
    for a, b in zip(cfx.tree.leaves(got), cfx.tree.leaves(want)):
        assert torch.equal(a, b)
    newer = save_sharded(tmp_path, cfx.tree.map(lambda x: x + 1, state()))  # the next save commits
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(os.listdir(tmp_path)) == {"index.json", *index["files"]}  # and leaves only its own files
    assert torch.equal(cfx.checkpoint.load(tmp_path, like())[0]["w"], newer["w"])


def test_damaged_or_mismatched_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no committed checkpoint.*no index.json"):
        cfx.checkpoint.load(tmp_path, like())
    save_sharded(tmp_path)
    shard = next(p for p in tmp_path.iterdir() if p.name.endswith(".safetensors"))
    bad = dict(like(), w=cfx.ShapeDtype((8, 8), torch.float32))
    with pytest.raises(ValueError, match="leaf 'w' is torch.float32 \\(8, 16\\) in the checkpoint but torch.float32 \\(8, 8\\)"):
        cfx.checkpoint.load(tmp_path, bad)
    with pytest.raises(ValueError, match="missing \\['extra'\\]"):
        cfx.checkpoint.load(tmp_path, dict(like(), extra=cfx.ShapeDtype((1,), torch.float32)))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the last tensor's data
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupted.*checksum"):
        cfx.checkpoint.load(tmp_path, like())
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(ValueError, match="truncated or was changed"):
        cfx.checkpoint.load(tmp_path, like())
    os.remove(shard)
    with pytest.raises(ValueError, match="is missing; copy the whole checkpoint directory"):
        cfx.checkpoint.load(tmp_path, like())


def test_partial_sums_and_non_tensors_are_refused_before_writing(tmp_path):
    with cfx.Mesh({"data": 2}) as mesh:
        a = cfx.device_put(torch.ones(4), mesh, P())
        partial = cfx.ShardedArray(a.shape, a.spec, mesh, a.blocks, partial=("data",))
        with pytest.raises(ValueError, match="leaf 'x' holds unreduced partial sums over \\('data',\\); psum it"):
            cfx.checkpoint.save(tmp_path / "p", {"x": partial})
        with pytest.raises(ValueError, match="leaf 'n' is a int"):
            cfx.checkpoint.save(tmp_path / "q", {"x": a, "n": 3})
    assert not os.path.exists(tmp_path / "p" / "index.json")


@pytest.mark.timeout(180)
def test_under_torchrun_each_process_writes_its_blocks_and_reads_its_own(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cfx_tests.checkpoint_script", str(tmp_path / "ckpt"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 6, generator=g), torch.randn(6, generator=g)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["written"] == ["g000001-p00000.safetensors", "g000001-p00001.safetensors"]
        assert got["meta"] == {"step": 3}
        assert torch.equal(got["blocks"]["w"], w[:, 3 * r:3 * r + 3])
        assert torch.equal(got["blocks"]["b"], b[3 * r:3 * r + 3])
    whole, _ = cfx.checkpoint.load(tmp_path / "ckpt", {"w": w, "b": b})  # and on one process
    assert torch.equal(whole["w"], w) and torch.equal(whole["b"], b)
    # a Plan's state: saved by "data=2 zero=3" (each process its pieces), loaded by "model=2"
    saved = [torch.load(tmp_path / f"rank{r}.pt")["saved"] for r in range(2)]
    cfx.tree.assert_tree_close(saved[0], saved[1], rtol=0, atol=0)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["plan_meta"] == {"step": 1, "plan": "data=2 zero=3"}
        cfx.tree.assert_tree_close(got["loaded"], saved[0], rtol=0, atol=0)
    like = cfx.eval_shape(lambda: saved[0])
    params, _ = cfx.checkpoint.load(str(tmp_path / "ckpt") + "-plan", {
        "params": like, "opt_state": cfx.eval_shape(cfx.optim.adamw(1e-3).init, like)})
    cfx.tree.assert_tree_close(params["params"], saved[0], rtol=0, atol=0)


def test_leaves_sharing_storage_are_saved_each_whole(tmp_path):
    w = torch.randn(8, 4)
    with cfx.Mesh({"data": 2}) as mesh:
        a = cfx.device_put(w, mesh, P())
        cfx.checkpoint.save(tmp_path, {"tied": a, "head": a, "plain": w, "again": w})  # one storage, four leaves
    got, _ = cfx.checkpoint.load(tmp_path, {k: w for k in ("tied", "head", "plain", "again")})
    assert all(torch.equal(t, w) for t in got.values())
