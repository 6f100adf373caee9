"""Byte-level text data for the training job: nothing is downloaded.

The default corpus is the source text of the running Python's standard library, read in sorted
path order so every machine with the same Python builds the same bytes.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Iterator, NamedTuple

import torch

from cfx._src.core import random as jr

VOCAB_SIZE = 256  # byte-level


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` bytes of ``*.py`` source from the standard library, as a uint8 tensor."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib")
                             and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return _to_tensor(b"".join(chunks)[:max_bytes])
    if not chunks:
        raise ValueError(f"no Python source found under {root!r}; pass --data PATH to a text file.")
    return _to_tensor(b"".join(chunks))


def text_file(path: str) -> torch.Tensor:
    """The bytes of a text file, as a uint8 tensor."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file; pass a path to a UTF-8 text file.")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"--data {path!r}: the file is empty; pass a text file to train on (or leave "
                         "--data out to train on Python's own sources).")
    return _to_tensor(data)


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def train_val_split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = max(int(len(data) * val_fraction), 1)
    return data[:-n_val], data[-n_val:]


def sample_batch(data: torch.Tensor, key: torch.Tensor, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: ``tokens (B, T)`` and next-byte ``targets (B, T)``, both int64."""
    if len(data) < seq_len + 2:
        raise ValueError(f"the data has {len(data)} bytes, fewer than seq_len + 2 = {seq_len + 2}; "
                         "use a shorter --seq or a larger --data file.")
    starts = jr.randint(key, (batch,), 0, len(data) - seq_len - 1)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def batches(data: torch.Tensor, key: torch.Tensor, batch: int, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of batches; batch ``i`` depends only on ``fold_in(key, i)``."""
    i = 0
    while True:
        yield sample_batch(data, jr.fold_in(key, i), batch, seq_len)
        i += 1


class RunKeys(NamedTuple):
    init: torch.Tensor      # the params' init
    data: torch.Tensor      # training batch i: fold_in(data, i)
    val: torch.Tensor       # eval batch i: fold_in(val, i)
    dropout: torch.Tensor   # dropout of training step i: fold_in(dropout, i)


def run_keys(seed: int) -> RunKeys:
    """The keys ``python -m cfx.train --seed SEED`` splits its seed into, in its order."""
    return RunKeys(*jr.split(jr.key(seed), 4))
