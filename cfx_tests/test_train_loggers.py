"""``python -m cfx.train --log tensorboard:DIR``: the losses the run logs to ``--metrics`` are the scalars
TensorBoard reads back (torch's ``SummaryWriter``, read with tensorboard's own ``EventAccumulator``), a
resumed run's steps replace a killed run's in both, and a bad ``--log`` is refused before step 0."""
import json
import sys

import numpy as np
import pytest

from cfx._src.train.loggers import RunLog
from cfx.train import TrainConfig, main, train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(directory) -> dict[str, dict[int, float]]:
    acc = event_accumulator.EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(120)
def test_tensorboard_scalars_are_the_logged_losses(tmp_path):
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    summary = train(TrainConfig(steps=4, batch=2, seq=16, eval_every=2, eval_batches=1, progress=False,
                                sample_bytes=0, metrics=str(metrics), log=f"tensorboard:{tb}"))
    got, records = scalars(tb), jsonl(metrics)
    train_losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert list(train_losses) == [1, 2, 3, 4] and list(got["loss/train"]) == [1, 2, 3, 4]
    for step, loss in train_losses.items():  # TensorBoard keeps float32
        assert got["loss/train"][step] == np.float32(loss)
    assert {r["step"]: np.float32(r["eval"]) for r in records if "eval" in r} == got["loss/eval"]
    assert list(got["loss/eval"]) == [0, 2, 4] and got["loss/eval"][4] == np.float32(summary["eval_loss_last"])
    assert all(v > 0 for v in got["tokens_per_s"].values()) and list(got["tokens_per_s"]) == [1, 2, 3, 4]


def test_a_resumed_run_replaces_what_a_killed_run_logged_past_its_start(tmp_path):
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    first = RunLog(metrics=str(metrics), log=f"tensorboard:{tb}", start=0, is_main=True)
    for step in range(1, 5):  # the killed run got to step 4; its checkpoint is step 2's
        first(step=step, loss=10.0 + step)
    first.close()
    resumed = RunLog(metrics=str(metrics), log=f"tensorboard:{tb}", start=2, is_main=True)
    for step in (3, 4):
        resumed(step=step, loss=float(step))
    resumed.close()
    want = {1: 11.0, 2: 12.0, 3: 3.0, 4: 4.0}
    assert scalars(tb)["loss/train"] == want
    assert {r["step"]: r["loss"] for r in jsonl(metrics)} == want and len(jsonl(metrics)) == 4
    nothing = RunLog(metrics=str(metrics), log=f"tensorboard:{tmp_path / 'other'}", start=0, is_main=False)
    nothing(step=1, loss=1.0)  # not process 0: writes nothing
    nothing.close()
    assert not (tmp_path / "other").exists() and len(jsonl(metrics)) == 4


def test_a_bad_log_is_refused_before_step_0(tmp_path, capsys, monkeypatch):
    assert main(["--log", f"wandb:{tmp_path}", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--log 'wandb:" in err and "expected one of tensorboard:DIR" in err
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    assert main(["--log", f"tensorboard:{tmp_path}", "--steps", "1", "--no-progress"]) == 2
    assert "pip install 'cfx[tensorboard]'" in capsys.readouterr().err
