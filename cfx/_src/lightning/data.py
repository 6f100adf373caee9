"""Byte-level text for a Lightning fit: the batches ``python -m cfx.train`` draws, in its order.

``ByteData`` is a ``LightningDataModule`` over the training job's corpus (``train.data``: the
standard library's source text, or a file), split as the job splits it. Batch ``i`` of a run is
``sample_batch(train, fold_in(k_data, i), batch, seq)`` and the validation batches are the job's
eval batches, with the keys the job derives from its seed (``train.data.run_keys``), so a fit with the same
seed sees the same bytes as ``python -m cfx.train``. The training batches come from ``Batches``, a
stateful iterable: Lightning saves its position with the loops, so a fit resumed from a checkpoint
continues the stream where it stopped (not from the start of the epoch).
"""
from __future__ import annotations

from typing import Any, Iterator

import lightning.pytorch as pl
import torch

from cfx._src.core import random as jr
from cfx._src.train import data as data_lib
from cfx._src.train.config import TrainConfig


class Batches:
    """Training batches as an endless stream cut into epochs of ``length``: batch ``i`` of the
    stream is ``sample_batch(data, fold_in(key, i), batch, seq)``. Sized (Lightning then fetches
    no batch ahead) and stateful (``state_dict`` / ``load_state_dict``: the next batch's index)."""

    def __init__(self, data: torch.Tensor, key: torch.Tensor, *, batch: int, seq: int, length: int):
        self.data, self.key, self.batch, self.seq, self.length = data, key, batch, seq, length
        self.position = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:  # to the end of the epoch the position is in (all of it, from its start)
            i, self.position = self.position, self.position + 1
            yield data_lib.sample_batch(self.data, jr.fold_in(self.key, i), self.batch, self.seq)
            if self.position % self.length == 0:
                return

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class Fixed:
    """A fixed list of batches as one Lightning dataloader (a bare list would be read as several)."""

    def __init__(self, batches: list):
        self.batches = list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


class ByteData(pl.LightningDataModule):
    """The training job's data (module doc): ``batch`` sequences of ``seq`` bytes per step, from
    ``data`` (a text file; None: the standard library's source), keys from ``seed``; an epoch is
    ``epoch`` batches, validation ``eval_batches`` batches. Every process yields the same global
    batches: the Plan's program splits them over its ``data`` axis."""

    def __init__(self, *, batch: int = 16, seq: int = 128, seed: int = 0, data: str | None = None,
                 eval_batches: int = 8, epoch: int = 1000):
        super().__init__()
        if min(batch, seq, eval_batches, epoch) < 1:
            raise ValueError(f"ByteData: batch={batch}, seq={seq}, eval_batches={eval_batches} and epoch={epoch} "
                             "must be positive.")
        self.batch, self.seq, self.seed, self.path = batch, seq, seed, data
        self.eval_batches, self.epoch = eval_batches, epoch
        self._train: Batches | None = None
        self._val: Fixed | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "ByteData":
        """The data of ``python -m cfx.train`` run with ``cfg`` (one epoch is ``cfg.steps`` batches)."""
        return cls(batch=cfg.batch, seq=cfg.seq, seed=cfg.seed, data=cfg.data, eval_batches=cfg.eval_batches,
                   epoch=cfg.steps)

    def setup(self, stage: str) -> None:
        if self._train is not None:
            return
        corpus = data_lib.text_file(self.path) if self.path else data_lib.stdlib_corpus()
        train, val = data_lib.train_val_split(corpus)
        keys = data_lib.run_keys(self.seed)
        self._train = Batches(train, keys.data, batch=self.batch, seq=self.seq, length=self.epoch)
        self._val = Fixed(data_lib.sample_batch(val, jr.fold_in(keys.val, i), self.batch, self.seq)
                          for i in range(self.eval_batches))

    def train_dataloader(self) -> Batches:
        return self._train

    def val_dataloader(self) -> Fixed:
        return self._val

    def test_dataloader(self) -> Fixed:
        return self._val
