"""``python -m cfx.bench capacity``: its memory cap really kills and really measures, its directory
and size parsing, its ladder's parameter count, and the smoke run's rows (where cgroups can be written)."""
import os
import sys

import pytest

import cfx
from cfx.bench import capacity, cgroup

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
@pytest.mark.timeout(120)
def test_capped_files_equal_uncapped_memory_bit_for_bit(tmp_path):
    # the rows themselves are checked for form by test_bench_smoke; here the equality behind one of them
    cfg = capacity.LADDERS["smoke"]
    uncapped = capacity.run_one(None, "cfx", cfg["same"], cfg, str(tmp_path), digest=True)
    capped = capacity.run_one(cgroup.MemoryCap(cfg["cap"]), "nvme", cfg["same"], cfg, str(tmp_path), digest=True)
    assert uncapped["trained"] and capped["trained"] and len(capped["losses"]) == 3
    assert capped["digest"] == uncapped["digest"] and capped["losses"] == uncapped["losses"]
    assert 0 < capped["anon_peak"] <= cfg["cap"] and capped["io"][-1]["read_bytes"] > 0
    assert not os.path.exists(tmp_path / "state")  # the state's files removed with the run
