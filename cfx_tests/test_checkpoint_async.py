"""Asynchronous saves (``cfx._src.checkpoint.background``): a save that returns once the state is
copied to host memory and is written while training goes on loads bitwise equal to a synchronous
save of the same step, even though the next steps change the state in place; one save is in flight
at a time; a failed write raises (never lost); a process killed during the background write keeps
the previous checkpoint, and the next save clears what it left. ``--async-save`` in the CLI is
here too; under torchrun in test_train_elastic."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import cfx
from cfx import P
from cfx._src.checkpoint import background
from cfx.parallel import Plan

B, T, V = 4, 16, 64


def gpt2():
    return cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_embd=32, n_head=4, n_positions=T)


def batches(n):
    d = cfx.random.randint(cfx.random.key(1), (n, B, T + 1), 0, V)
    return [(x[:, :-1], x[:, 1:]) for x in d]


def whole(directory):
    params = cfx.eval_shape(gpt2().init, cfx.random.key(0))
    like = {"params": params, "opt_state": cfx.eval_shape(cfx.optim.adamw(1e-3).init, params)}
    return cfx.checkpoint.load(directory, like)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2 zero=3", "data=2,model=2 zero=1"])
def test_an_async_save_loads_equal_to_a_sync_save_of_the_same_step(tmp_path, text):
    plan = Plan.parse(text)
    with plan.make_mesh() as mesh:
        program = plan.step(gpt2(), cfx.optim.adamw(1e-3), mesh=mesh)
        state = program.init(cfx.random.key(0))
        data = batches(4)
        state, _ = program(state, data[0])
        program.save(tmp_path / "sync", state, metadata={"step": 1})
        pending = program.save(tmp_path / "async", state, metadata={"step": 1}, async_=True)
        assert isinstance(pending, cfx.checkpoint.PendingSave)
        for batch in data[1:]:  # the steps donate the state and update it in place meanwhile
            state, _ = program(state, batch)
        pending.wait()
        again = program.save(tmp_path / "async-file.safetensors", state, async_=True)  # the gathered file too
        final = program.params(state)
    cfx.checkpoint.wait()
    assert again.done()
    sync, meta_s = whole(tmp_path / "sync")
    got, meta_a = whole(tmp_path / "async")
    cfx.tree.assert_tree_close(got, sync, rtol=0, atol=0)
    assert meta_a == meta_s == {"step": 1, "plan": text}
    file_state, _ = whole(tmp_path / "async-file.safetensors")
    cfx.tree.assert_tree_close(file_state["params"], final, rtol=0, atol=0)
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "async"))


def test_async_saves_of_a_tree_follow_one_another_and_later_ones_win(tmp_path):
    w = torch.zeros(64, 64)
    pending = []
    for step in range(1, 4):
        w.add_(1.0)  # the caller changes its tensor right after each save returns
        pending.append(cfx.checkpoint.save(tmp_path / "w.safetensors", {"w": w}, metadata={"step": step},
                                           async_=True))
    got, meta = cfx.checkpoint.load(tmp_path / "w.safetensors", {"w": w})  # waits for the one in flight
    assert meta == {"step": 3} and torch.equal(got["w"], torch.full((64, 64), 3.0))
    assert all(p.done() for p in pending)


def test_one_save_is_in_flight_the_next_waits_for_it():
    gate, order = threading.Event(), []
    first = background.start(lambda: (gate.wait(5), order.append(1)), "first")
    later = threading.Thread(target=lambda: (background.start(lambda: order.append(2), "second"),
                                             background.wait()))
    later.start()
    time.sleep(0.2)
    assert not first.done() and later.is_alive() and order == []  # the second is held back
    gate.set()
    later.join(5)
    assert order == [1, 2]


def test_a_failed_background_write_raises_on_wait():
    def fail():
        raise OSError("No space left on device")
    background.start(fail, "to 'full-disk'")
    with pytest.raises(RuntimeError, match=r"background save to 'full-disk' failed: No space left on device"):
        background.wait()
    background.wait()  # raised once, then gone


KILLED = """
import os, signal, sys, torch
import cfx
from cfx import P
d = sys.argv[1]
with cfx.Mesh({"data": 2}) as mesh:
    def arr(v):
        return cfx.device_put(torch.full((4096, 2048), float(v)), mesh, P("data"))  # 32 MiB
    cfx.checkpoint.save(d, {"w": arr(1)}, metadata={"step": 1})
    cfx.checkpoint.save(d, {"w": arr(2)}, metadata={"step": 2}, async_=True)
    os.kill(os.getpid(), signal.SIGKILL)  # while the background thread writes
"""


@pytest.mark.timeout(120)
def test_a_kill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", KILLED, str(d)], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    like = {"w": torch.zeros(4096, 2048)}
    got, meta = cfx.checkpoint.load(d, like)
    assert meta == {"step": 1} and torch.equal(got["w"], torch.ones(4096, 2048))
    stale = d / ".tmpAbC123"  # what safetensors' own temporary file looks like when its writer died
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    with cfx.Mesh({"data": 2}) as mesh:  # the next save clears what the killed one left
        cfx.checkpoint.save(d, {"w": cfx.device_put(torch.full((4096, 2048), 3.0), mesh, P("data"))},
                            metadata={"step": 3})
    assert sorted(n for n in os.listdir(d)) == ["g000002-p00000.safetensors", "index.json"]  # the dead files
    got, meta = cfx.checkpoint.load(d, like)
    assert meta == {"step": 3} and torch.equal(got["w"], torch.full((4096, 2048), 3.0))
