"""Text data for the training job, as bytes or a Hugging Face tokenizer's ids: nothing is downloaded.

The default corpus is the source text of the running Python's standard library, read in sorted
path order so every machine with the same Python builds the same bytes.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Any, Iterator, NamedTuple

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


def documents(path: str) -> list[bytes]:
    """``--data``'s documents: a text file (one), or a directory's ``*.txt`` files in sorted path order."""
    if os.path.isdir(path):
        names = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".txt"))
        if not names:
            raise ValueError(f"--data {path!r}: a directory without *.txt files; put the documents there as text files.")
    elif os.path.isfile(path):
        names = [path]
    else:
        raise ValueError(f"--data {path!r}: no such file or directory; pass a UTF-8 text file or a directory of *.txt.")
    docs = []
    for name in names:
        with open(name, "rb") as f:
            docs.append(f.read())
    if not any(docs):
        what = "the file is empty" if len(names) == 1 and names[0] == path else "its text files are empty"
        raise ValueError(f"--data {path!r}: {what}; pass text to train on (or leave --data out to train on Python's "
                         "own sources).")
    return docs


def text_file(path: str) -> torch.Tensor:
    """The bytes of a text file (a directory's documents, a blank line between), as a uint8 tensor."""
    return _to_tensor(b"\n\n".join(documents(path)))


def load_tokenizer(directory: str) -> Any:
    """The Hugging Face tokenizer in ``directory`` (local files only: nothing is downloaded)."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError("--tokenizer needs transformers: pip install 'cfx[hf]'.") from e
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {directory!r}: no Hugging Face tokenizer there ({type(e).__name__}); give the "
                         "directory tokenizer.save_pretrained wrote (a model directory often holds one).") from e


def tokenized(path: str | None, tokenizer: Any) -> torch.Tensor:
    """``--data`` (or the stdlib's sources) as ``tokenizer``'s ids, int64: each document's ids followed by the
    tokenizer's end-of-text token, so windows that cross a document boundary see where one ends."""
    docs = documents(path) if path else [bytes(stdlib_corpus(2 << 20).numpy())]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for doc in docs:
        ids += list(tokenizer.encode(doc.decode("utf-8", errors="replace"))) + eos
    return torch.tensor(ids, dtype=torch.int64)


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
