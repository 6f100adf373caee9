"""Two hosts on one machine (cfx.bench.twohost): network namespaces joined by a shaped veth pair, a
torchrun job across them; a data=2 plan trained over the two hosts equals one process, and the
namespaces are gone afterwards. (The collective timings against the estimate: python -m cfx.bench estimate.)"""
import subprocess

import pytest
import torch

from cfx.bench import twohost
from cfx.bench.twohost_worker import training

WHY = twohost.available()


@pytest.mark.timeout(180)
@pytest.mark.skipif(WHY is not None, reason=f"two network namespaces cannot be made here: {WHY}")
def test_two_hosts_train_as_one_process_and_leave_nothing_behind():
    with twohost.Hosts(rate="1gbit") as hosts:
        names = hosts.names
        out = hosts.run(["-m", "cfx.bench.twohost_worker", "--sizes", "4194304", "--reps", "2", "--steps", "2"])
    ops = {r["op"] for r in out["collectives"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter"} and all(r["seconds"] > 0 for r in out["collectives"])
    # 4 MiB summed over two hosts sends 2 MiB each way in two phases: past tbf's 512 KiB bucket, at least
    # 25 ms at 1 Gbit/s -- the traffic crossed the shaped link (an unshaped veth takes a few ms)
    assert min(r["seconds"] for r in out["collectives"] if r["op"] == "all_reduce") > 20e-3
    losses, params = training(2, "single-device")
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(losses))
    torch.testing.assert_close(torch.tensor(out["params"]), torch.tensor(params))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
