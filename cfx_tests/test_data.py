"""Byte-level data: deterministic corpus and batches whose targets are the next bytes."""
import pytest
import torch

import cfx
from cfx._src.train import data


def test_stdlib_corpus_is_deterministic_python_source():
    a, b = data.stdlib_corpus(max_bytes=200_000), data.stdlib_corpus(max_bytes=200_000)
    assert a.dtype == torch.uint8 and len(a) == 200_000 and torch.equal(a, b)
    assert b"def " in bytes(a[:200_000].tolist())


def test_batches_are_shifted_windows(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 4)
    corpus = data.text_file(str(path))
    x, y = data.sample_batch(corpus, cfx.random.key(0), batch=3, seq_len=10)
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal((x[:, 0] + 1) % 256, y[:, 0])
    x2, _ = data.sample_batch(corpus, cfx.random.key(0), batch=3, seq_len=10)
    assert torch.equal(x, x2)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        data.text_file("/nonexistent/file.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"--data '.*empty\.txt': the file is empty"):
        data.text_file(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="seq_len"):
        data.sample_batch(torch.zeros(5, dtype=torch.uint8), cfx.random.key(0), 1, 10)
