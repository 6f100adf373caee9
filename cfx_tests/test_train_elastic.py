"""Jobs that survive: ``torchrun --max-restarts`` with ``python -m cfx.train --save DIR --resume auto``.

A worker of a 4-process job (``data=4 zero=3``, gloo, asynchronous saves) is killed with SIGKILL
at a step drawn from a seeded schedule; torchrun restarts the workers, which continue from the newest
committed checkpoint. Every loss the job logged (``--metrics``: the steps before the kill, and again
from the checkpoint on) equals the uninterrupted run's at that step, bitwise, and so does the final
checkpoint. A job saved on 4 processes and relaunched on 2 with a plan that fits them (``data=2
zero=3``, ``pipe=2``) continues from the same checkpoint and data order: bitwise equal to that plan
resumed from it in one process (the ``local`` backend), and within the rounding of the reductions of
the 4-process run. ``--resume auto`` before any save starts from step 0; a checkpoint of another
model is a one-line error on every rank.

The uninterrupted references run in this process on the ``local`` backend (threads), which computes
what the processes compute, bitwise. The suite draws one kill and relaunches onto ``data=2 zero=3``;
``CFX_HYPOTHESIS=sweep`` draws five kills and relaunches onto ``pipe=2`` too (both pass: README).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import cfx
from cfx.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
COMMON = ["--steps", str(STEPS), "--batch", "4", "--seq", "32", "--eval-every", "0", "--eval-batches", "1",
          "--sample-bytes", "0", "--no-progress", "--threads", "1"]
FOUR = ["--mesh", "data=4", "--zero", "3"]
SWEEP = os.environ.get("CFX_HYPOTHESIS") == "sweep"
KILLS = 5 if SWEEP else 1
RELAUNCH_PLANS = {"data2-zero3": ["--mesh", "data=2", "--zero", "3"], "pipe2": ["--mesh", "pipe=2", "--microbatches", "2"]}
RELAUNCHES = 2 if SWEEP else 1  # the suite relaunches onto data=2 zero=3; the sweep onto pipe=2 as well


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


def logged(path) -> dict[int, list[float]]:
    """``{step: [every train loss logged for it]}`` from a ``--metrics`` file."""
    out: dict[int, list[float]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                out.setdefault(row["step"], []).append(row["loss"])
    return out


def reference(corpus, tmp, *flags) -> tuple[dict[int, list[float]], str]:
    """An uninterrupted run in this process: its logged losses and its final checkpoint."""
    metrics, save = tmp / f"ref-{len(os.listdir(tmp))}.jsonl", str(tmp / f"ref-{len(os.listdir(tmp))}")
    assert main([*COMMON, "--data", corpus, "--metrics", str(metrics), "--save", save, *flags]) == 0
    return logged(metrics), save


def torchrun(nproc: int, *flags, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "-m", "cfx.train", *COMMON, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return err


def kill_a_worker_at(proc: subprocess.Popen, metrics, step: int, rng: random.Random, timeout: float = 120) -> None:
    """SIGKILL one of ``proc``'s workers once the job has logged ``step``."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(metrics) and any(s >= step for s in logged(metrics))):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} was not reached in {timeout} s"
        time.sleep(0.05)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "cfx.train" in " ".join(p.cmdline())]
    assert workers, "no worker to kill"
    os.kill(rng.choice(workers).pid, signal.SIGKILL)


def same_state(a: str, b: str) -> None:
    from cfx._src.train.saving import read_params
    (_, pa), (_, pb) = read_params(a), read_params(b)
    cfx.tree.assert_tree_close(pa, pb, rtol=0, atol=0)


@pytest.fixture(scope="module")
def four(corpus, tmp_path_factory):
    """The uninterrupted ``data=4 zero=3`` run: its losses and final checkpoint."""
    return reference(corpus, tmp_path_factory.mktemp("four"), *FOUR)


@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_from_the_last_save_and_the_job_ends_as_if_uninterrupted(corpus, tmp_path, four):
    plan = FOUR
    want, want_ckpt = four
    assert sorted(want) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in want.values())
    rng = random.Random(0)
    for run in range(KILLS):
        at = rng.randrange(2, STEPS)  # after the first save (every 2 steps), before the end
        metrics, save = tmp_path / f"job{run}.jsonl", str(tmp_path / f"job{run}")
        proc = torchrun(4, "--data", corpus, *plan, "--save", save, "--save-every", "2", "--async-save",
                        "--resume", "auto", "--metrics", str(metrics), restarts=2)
        kill_a_worker_at(proc, metrics, at, rng)
        err = finish(proc)
        # restarted: from the last committed save, or from step 0 if the kill came before the first commit
        assert "(torchrun's restart 1)" in err, err[-3000:]
        got = logged(metrics)
        assert sorted(got) == sorted(want)
        for step, losses in got.items():  # each step as uninterrupted, however often it ran
            assert losses == want[step] * len(losses), (run, at, step)
        same_state(save, want_ckpt)


@pytest.mark.timeout(600)
def test_a_job_saved_on_four_processes_continues_on_two_under_other_plans(corpus, tmp_path, four):
    want, _ = four
    save = str(tmp_path / "job")
    finish(torchrun(4, "--data", corpus, *FOUR, "--save", save, "--stop-after", str(STEPS // 2)))
    for name, plan in list(RELAUNCH_PLANS.items())[:RELAUNCHES]:
        job, half = str(tmp_path / name), str(tmp_path / f"{name}-half")
        shutil.copytree(save, job)
        shutil.copytree(save, half)
        metrics = tmp_path / f"{name}.jsonl"
        err = finish(torchrun(2, "--data", corpus, *plan, "--save", job, "--resume", "auto", "--metrics", str(metrics)))
        assert f"continuing from {job!r} at step {STEPS // 2}" in err
        got = logged(metrics)
        assert sorted(got) == list(range(STEPS // 2 + 1, STEPS + 1))
        own, own_ckpt = reference(corpus, tmp_path, *plan, "--resume", half)  # that plan from there, in one process
        assert got == own, name  # bitwise on its own plan
        same_state(job, own_ckpt)
        torch.testing.assert_close(torch.tensor([v[0] for _, v in sorted(got.items())]),
                                   torch.tensor([want[s][0] for s in sorted(got)]), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_resume_auto_starts_fresh_without_a_checkpoint_and_refuses_another_models(corpus, tmp_path, capsys):
    save = str(tmp_path / "job")
    flags = ["--data", corpus, "--mesh", "data=2", "--save", save, "--resume", "auto", "--steps", "2"]
    assert main([*COMMON, *flags]) == 0
    assert "no committed checkpoint at" in capsys.readouterr().err
    proc = torchrun(2, *flags, "--preset", "small")
    _, err = proc.communicate(timeout=150)  # a checkpoint of another model: refused on every rank, in one line
    assert proc.returncode != 0
    refusals = [line for line in err.splitlines() if line.startswith("error: --resume")]
    assert len(refusals) == 2, err[-3000:]
    assert "the checkpoint has 4 blocks, the model 12" in refusals[0] and "--preset tiny" in refusals[0]
