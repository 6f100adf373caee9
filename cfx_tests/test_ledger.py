"""Collective matching and failure reports (cfx/_src/mesh/ledger.py): ranks that disagree on a
collective raise a named error at once instead of hanging, mixing up values or aborting; a rank
that fails before its first collective releases its peers at once; timeouts name who waited where.
Multi-process cases run under torchrun with 2 processes (``spmd_safety_script``)."""
import os
import subprocess
import sys
import time

import pytest
import torch

import cfx
from cfx import P
from cfx._src.lax import groups, p2p
from cfx._src.mesh.ledger import CollectiveMismatch, CollectiveTimeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(body, x, *, timeout=5.0, check=None, out_specs=P("data")):
    with cfx.Mesh({"data": 2}, timeout=timeout, check_collectives=check) as mesh:
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs)(x))


@pytest.mark.timeout(30)
def test_a_rank_failing_before_its_first_collective_releases_the_others_at_once():
    def body(x):
        if x.item() == 1.0:  # rank 1 fails before it ever meets rank 0 on "data"
            raise KeyError("bad batch on rank 1")
        return cfx.lax.psum(x, "data")
    t0 = time.perf_counter()
    with pytest.raises(KeyError, match="bad batch on rank 1") as info:
        run(body, torch.tensor([0.0, 1.0]))
    assert time.perf_counter() - t0 < 1.0  # not the 5 s timeout, nor the store's
    assert "raised on rank 1" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["op", "shape", "dtype"])
def test_mismatched_collectives_raise_naming_both_sides(kind):
    def body(x):
        r = int(x.item())
        if kind == "op":
            return cfx.lax.pmax(x, "data") if r == 1 else cfx.lax.psum(x, "data")
        if kind == "shape":
            return cfx.lax.psum(x.repeat(1 + r), "data")[:1]
        return cfx.lax.psum(x.double() if r == 1 else x, "data").float()
    t0 = time.perf_counter()
    with pytest.raises(CollectiveMismatch) as info:
        run(body, torch.tensor([0.0, 1.0]))
    assert time.perf_counter() - t0 < 1.0
    msg = str(info.value)
    assert "rank 0 {'data': 0} runs psum #1 over ('data',)" in msg and "rank 1 {'data': 1} runs " in msg
    assert {"op": "pmax #1", "shape": "(2,)", "dtype": "torch.float64"}[kind] in msg
    assert "same order, with the same shapes and dtypes" in msg


ABORT = """
import torch, cfx
from cfx import P
with cfx.Mesh({"data": 2}, timeout=5) as mesh:
    f = cfx.shard_map(lambda x: cfx.lax.psum(x.repeat(1 + int(x.item())), "data")[:1], mesh=mesh,
                      in_specs=P("data"), out_specs=P("data"))
    try:
        f(torch.tensor([0.0, 1.0]))
    except Exception as e:
        print("RAISED", type(e).__name__, str(e).splitlines()[0])
    print("ALIVE", cfx.device_get(f(torch.tensor([0.0, 0.0]))).tolist())  # the mesh still works
"""


@pytest.mark.timeout(120)
def test_a_shape_mismatch_is_an_exception_not_a_process_abort():
    proc = subprocess.run([sys.executable, "-c", ABORT], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]  # gloo's EnforceNotMet used to SIGABRT here
    assert "RAISED CollectiveMismatch collective mismatch over mesh axes ('data',)" in proc.stdout
    assert "ALIVE [0.0, 0.0]" in proc.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first", [True, False])
def test_a_rank_that_skips_a_collective_is_named_at_once(first):
    def body(x):
        if not first:
            x = x + 0 * cfx.lax.psum(x, "data")  # both ranks; rank r still holds r
        if x.item() == 0.0:
            x = cfx.lax.psum(x, "data")  # rank 1 never issues this one
        return x
    t0 = time.perf_counter()
    what = "its first collective" if first else r"psum #2 over \('data',\) \(torch.float32 \(1,\)\)"
    with pytest.raises(CollectiveMismatch, match=r"over mesh axes \('data',\): rank\(s\) \[1\] returned from the "
                                                 rf"shard_map body without issuing {what}, which rank\(s\) \[0\] wait in"):
        run(body, torch.tensor([0.0, 1.0]))
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.timeout(30)
def test_a_point_to_point_message_with_another_shape_is_refused():
    def body(x):
        ax = groups.axes(("data",), "test")
        if x.item() == 0.0:
            p2p.send(torch.zeros(3), ax, 1, tag=7).wait()
        else:
            p2p.recv((4,), torch.float32, "cpu", ax, 0, tag=7)
        return x
    with pytest.raises(CollectiveMismatch, match=r"message #1 over \('data',\) \(torch.float32 \(3,\), tag 7\).*"
                                                 r"message #1 over \('data',\) \(torch.float32 \(4,\), tag 7\)"):
        run(body, torch.tensor([0.0, 1.0]))


@pytest.mark.timeout(30)
def test_a_timeout_names_the_rank_the_op_its_number_and_who_reached_it():
    def body(x):
        x = cfx.lax.psum(x, "data")  # both ranks: the group is made and used once
        if cfx.lax.axis_index("data") == 1:
            time.sleep(3.0)  # longer than the mesh's timeout
        return cfx.lax.pmax(x, "data")
    t0 = time.perf_counter()
    with pytest.raises(CollectiveTimeout) as info:
        run(body, torch.tensor([0.0, 1.0]), timeout=1.0)
    assert time.perf_counter() - t0 < 5.0
    msg = str(info.value)
    assert msg.startswith("rank 0 {'data': 0}: pmax #2 over ('data',) (torch.float32 (1,)) timed out after 1 s")
    assert "ranks [0] of the group reached it; rank 1: last issued psum #1 over ('data',)" in msg
    assert "Mesh(timeout=...)" in msg


@pytest.mark.timeout(30)
def test_check_collectives_false_is_the_opt_out():
    # unchecked, a psum meeting a pmax combines silently (what the check exists to catch)
    body = lambda x: cfx.lax.pmax(x, "data") if x.item() == 1.0 else cfx.lax.psum(x, "data")  # noqa: E731
    got = run(body, torch.tensor([1.0, 1.0]), check=False)
    assert got.shape == (2,)
    with pytest.raises(CollectiveMismatch):
        run(body, torch.tensor([0.0, 1.0]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["mismatch", "timeout"])
def test_torchrun_ranks_each_raise_the_named_error(case, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cfx_tests.spmd_safety_script", case, str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    if case == "mismatch":  # every rank sees both sides (the fingerprint exchange)
        for line in lines:
            assert "CollectiveMismatch" in line and "runs psum #2 over ('data',) (torch.float32 (4,))" in line
            assert "runs pmax #2 over ('data',) (torch.float32 (4,))" in line
    else:
        assert lines[0].startswith("RANK 0 CollectiveTimeout rank 0 {'data': 0}: psum #2 over ('data',)")
        assert "timed out after 3 s; ranks [0] of the group reached it" in lines[0]
        assert lines[1] == "RANK 1 skipped"
    assert time.perf_counter() - t0 < 60
