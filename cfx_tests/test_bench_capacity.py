"""``python -m cfx.bench capacity``: its memory cap really kills and really measures, its directory
and size parsing, its ladder's parameter count, and the smoke run's rows (where cgroups can be written)."""
import json
import os
import sys

import pytest

import cfx
from cfx.bench import capacity, cgroup
from cfx_tests.test_bench_smoke import check_well_formed

MiB = 1 << 20
WHY = cgroup.version()[1]


def test_ladder_parameter_count_is_the_models():
    for width, layers in [(64, 1), (384, 6), (640, 10)]:
        model = cfx.models.gpt2("tiny", n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=50257,
                                n_positions=1024)
        n = sum(x.numel() for x in cfx.tree.leaves(cfx.eval_shape(model.init, cfx.random.key(0))))
        assert capacity.params_of(width, layers, 50257) == n


def test_sizes_and_directories():
    assert capacity.parse_bytes("2GiB") == 2 << 30 and capacity.parse_bytes("512MiB") == 512 * MiB
    assert capacity.parse_bytes("1000") == 1000 and capacity.parse_bytes("1.5G") == 3 << 29
    with pytest.raises(ValueError, match="give bytes like"):
        capacity.parse_bytes("lots")
    if capacity.filesystem_of("/dev/shm") == "tmpfs":
        with pytest.raises(ValueError, match="on tmpfs.*charged to the very cap"):
            capacity.check_dir("/dev/shm/cfx")


@pytest.mark.skipif(cgroup.version()[0] is None, reason=f"memory cgroups: {WHY}")
@pytest.mark.timeout(60)
def test_the_cap_kills_what_exceeds_it_and_measures_what_fits():
    cap = cgroup.MemoryCap(96 * MiB)
    hold = "import time; x = bytearray({}); x[::4096] = b'1' * len(x[::4096]); time.sleep(0.3)"
    fits = cap.run([sys.executable, "-c", hold.format(40 * MiB)], timeout=30)
    assert fits.ok and 40 * MiB <= fits.anon_peak <= 96 * MiB, fits
    over = cap.run([sys.executable, "-c", hold.format(200 * MiB)], timeout=30)
    assert not over.ok and over.oom_killed and over.anon_peak <= 96 * MiB, over
    assert not [d for d in os.listdir(cgroup.V1 if cap.version == 1 else cgroup.V2) if d.startswith(f"cfx-capacity-{os.getpid()}-")]


@pytest.mark.skipif(cgroup.version()[0] is None, reason=f"memory cgroups: {WHY}")
@pytest.mark.timeout(180)
def test_smoke_rows(tmp_path):
    # this bench's smoke runs here only (test_bench_smoke.OWN_SMOKE): its form, then what its rows say
    out = capacity.run(smoke=True, json_path=str(tmp_path / "c.json"), directory=str(tmp_path))
    check_well_formed("capacity", json.loads((tmp_path / "c.json").read_text()))
    rows = {r["metric"]: r for r in out["rows"]}
    assert rows["capped_equals_uncapped"]["ok"]  # the nvme engine under the cap: the in-memory Program's bits
    assert rows["largest_cfx_nvme"]["value"] > 0 and rows["largest_pytorch"]["value"] > 0
    assert 0 < rows["anon_peak_vs_cap"]["value"] <= 1.0 and rows["largest_loss_goes_down"]["ok"]
    assert rows["io_seconds_per_step"]["value"] > 0 and rows["disk_read_bandwidth"]["value"] > 0
    assert os.listdir(tmp_path) == ["c.json"]  # its working directory (and the state's files) removed


def test_without_cgroups_it_says_why_in_one_row(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "version", lambda: (None, "no memory cgroup is mounted"))
    out = capacity.run(smoke=True, json_path=str(tmp_path / "c.json"), directory=str(tmp_path))
    check_well_formed("capacity", json.loads((tmp_path / "c.json").read_text()))
    assert [r["unit"] for r in out["rows"]] == ["skipped: no memory cgroup is mounted"]
