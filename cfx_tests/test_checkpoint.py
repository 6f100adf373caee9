"""cfx.checkpoint: exact round trips, atomic writes, and errors naming the leaf."""
import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

import cfx
from cfx import checkpoint


class OptState(NamedTuple):
    count: torch.Tensor
    mu: dict


def sample():
    k = cfx.random.split(cfx.random.key(0), 3)
    params = {"blocks": [{"w": cfx.random.normal(k[0], (3, 4))}, {"w": cfx.random.normal(k[1], (4, 2))}],
              "scale": torch.tensor(2.0, dtype=torch.bfloat16)}
    return {"params": params, "opt_state": OptState(torch.tensor(7), cfx.tree.map(torch.zeros_like, params))}


def test_round_trip_is_exact_and_keeps_metadata(tmp_path):
    tree = sample()
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, tree, metadata={"step": 12, "note": "hi"})
    template = cfx.tree.map(torch.empty_like, tree)
    restored, meta = checkpoint.load(path, template)
    assert meta == {"step": 12, "note": "hi"}
    assert isinstance(restored["opt_state"], OptState)
    for a, b in zip(cfx.tree.leaves(restored), cfx.tree.leaves(tree)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_tied_and_view_tensors_are_saved(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    tree = {"a": w, "b": w, "row": w[1]}
    checkpoint.save(tmp_path / "c.safetensors", tree)
    restored, _ = checkpoint.load(tmp_path / "c.safetensors", cfx.tree.map(torch.empty_like, tree))
    assert torch.equal(restored["row"], w[1]) and torch.equal(restored["b"], w)


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, sample(), metadata={"step": 1})
    import safetensors.torch

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(RuntimeError):
        checkpoint.save(path, sample(), metadata={"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]  # no temp file left behind
    _, meta = checkpoint.load(path, sample())
    assert meta["step"] == 1  # the old checkpoint is intact


KILLED_MID_SAVE = """
import os, sys, torch
from cfx import checkpoint
os.fsync = lambda fd: os._exit(9)  # the process dies after the bytes are written, before the rename
checkpoint.save(sys.argv[1], {"w": torch.ones(1000)})
"""


def test_a_save_killed_mid_write_leaves_nothing_after_the_next_save(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(path)], timeout=120)
    assert proc.returncode == 9
    (left,) = os.listdir(tmp_path)  # the killed writer's temporary file, and no checkpoint
    assert left.startswith(".tmp-ckpt.safetensors-")
    (tmp_path / ".tmp-other.safetensors-x").write_text("")  # another checkpoint's: not ours to touch
    checkpoint.save(path, sample())
    assert sorted(os.listdir(tmp_path)) == [".tmp-other.safetensors-x", "ckpt.safetensors"]


def test_a_running_writers_temporary_file_is_kept(tmp_path):
    import socket
    live = tmp_path / f".tmp-c.safetensors-{socket.gethostname()}-{os.getpid()}-abc"
    live.write_text("")  # a save in progress in this process (another thread): not swept
    checkpoint.save(tmp_path / "c.safetensors", sample())
    assert live.exists()


def test_mismatch_names_the_leaf(tmp_path):
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, sample())
    wrong_shape = sample()
    wrong_shape["params"]["blocks"][1]["w"] = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"params\.blocks\.1\.w"):
        checkpoint.load(path, wrong_shape)
    extra = sample()
    extra["params"]["new"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"params\.new"):
        checkpoint.load(path, extra)
    with pytest.raises(ValueError, match="no checkpoint"):
        checkpoint.load(tmp_path / "missing.safetensors", sample())


def test_unreadable_or_corrupted_files_are_one_line_errors_naming_the_path(tmp_path):
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, sample(), metadata={"step": 3})
    good = path.read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")  # safetensors: u64 header size, JSON header, data

    def load_bytes(data: bytes):
        path.write_bytes(data)
        return checkpoint.load(path, sample())
    for data, match in [(good[:len(good) // 2], "not a readable checkpoint"),   # a copy cut short
                        (b"PK\x03\x04 this is a zip", "not a readable checkpoint"),  # another format
                        (good[:header] + bytes(8) + good[header + 8:], r"leaf '.*' in .* is corrupted")]:
        with pytest.raises(ValueError, match=match) as info:
            load_bytes(data)
        assert str(path) in str(info.value) and "\n" not in str(info.value)
    flipped = bytearray(good)
    flipped[-3] ^= 0x10  # one bit in the last tensor's data
    with pytest.raises(ValueError, match=r"leaf '[a-z_.0-9]+' in .* is corrupted"):
        load_bytes(bytes(flipped))
    restored, meta = load_bytes(good)
    assert meta == {"step": 3}
