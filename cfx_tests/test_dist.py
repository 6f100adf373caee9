"""The same data-parallel and ZeRO-3 scripts on the local backend, under torchrun, and on one device."""
import json
import os
import subprocess
import sys

import pytest
import torch

import cfx
from cfx_tests import dp_train_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fp32(losses):
    """Losses computed in fp32 (JSON carries them as Python floats, which assert_close would hold
    to fp64's tolerances): data parallelism sums the gradient in another order, a last-bit change."""
    return torch.tensor(losses, dtype=torch.float32)


@pytest.mark.timeout(120)
def test_local_data_parallel_equals_single_device():
    torch.testing.assert_close(fp32(dp_train_script.data_parallel("local")), fp32(dp_train_script.single_device()))


@pytest.mark.timeout(180)
def test_torchrun_gloo_matches_local_backend():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "cfx_tests.dp_train_script"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    backend = next(l for l in proc.stdout.splitlines() if l.startswith("BACKEND "))[len("BACKEND "):]
    assert "gloo" in backend and ("nccl" in backend) == torch.cuda.is_available()  # CPU tensors: gloo; CUDA: NCCL
    line = next(l for l in proc.stdout.splitlines() if l.startswith("LOSSES "))
    torch.testing.assert_close(json.loads(line[len("LOSSES "):]), dp_train_script.data_parallel("local"))
    jitted = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("JIT "))[len("JIT "):])
    torch.testing.assert_close(jitted, dp_train_script.data_parallel("local", n_layer=1))  # a graph per process
    got = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("ZERO3 "))[len("ZERO3 "):])
    local_losses, local_held = dp_train_script.zero3("local")
    torch.testing.assert_close(got["losses"], local_losses)
    # a process holds its own quarter of the params and AdamW state (12 Psi/N bytes), no more
    psi = sum(x.numel() for x in cfx.tree.leaves(dp_train_script.setup()[1]))
    assert got["held"] * 4 == local_held and got["held"] <= 12 * psi / 4 * 1.02


@pytest.mark.timeout(120)
def test_local_zero3_with_state_across_steps_equals_single_device():
    losses, _ = dp_train_script.zero3("local")
    torch.testing.assert_close(fp32(losses), fp32(dp_train_script.single_device()))
