"""The same data-parallel script on the local backend, under torchrun, and on one device."""
import json
import os
import subprocess
import sys

import pytest
import torch

from cfx_tests import dp_train_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_local_data_parallel_equals_single_device():
    torch.testing.assert_close(dp_train_script.data_parallel("local"), dp_train_script.single_device())


@pytest.mark.timeout(180)
def test_torchrun_gloo_matches_local_backend():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "cfx_tests.dp_train_script"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("LOSSES "))
    torch.testing.assert_close(json.loads(line[len("LOSSES "):]), dp_train_script.data_parallel("local"))
