"""``python -m cfx.train --resume`` anywhere: a checkpoint written by one device or by a Plan on any mesh
continues under any other program -- one device, another mesh or strategy, back again -- with the losses
and the final state (params and AdamW moments) of an uninterrupted run: bitwise under the program that
saved it, else within the rounding of the sharded reductions (``TOL``). A checkpoint of another model or
optimizer is a ValueError that says what differs and which flags saved it. Each run goes through the
CLI's ``main(argv)`` in process (one under torchrun), at a size that takes a second or two."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import cfx
from cfx.train import TrainConfig, main

STEPS, HALF = 8, 4
COMMON = ["--steps", str(STEPS), "--batch", "4", "--seq", "32", "--eval-every", "0", "--eval-batches", "1",
          "--sample-bytes", "0", "--no-progress"]
MESH = "data=2,model=2"
# One device against data=2,model=2 (fp32): the model axis sums each block's matmuls in two halves and
# the data axis averages two half-batch losses, so the numbers differ by fp32 rounding (~1e-7 relative
# per step, carried forward by AdamW's normalised updates): over 8 steps that stays far inside 1e-4,
# while an optimizer state lost on the way (its step count and moments zero) moves the losses after the
# first resumed step by about 0.3 (``test_a_lost_optimizer_state_is_outside_the_tolerance``).
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


def cli(corpus, summary, *flags: str) -> tuple[list[int], list[float]]:
    """``(steps, train losses)`` of one run of ``python -m cfx.train`` (its ``--json`` summary at ``summary``)."""
    assert main([*COMMON, "--data", corpus, "--json", str(summary), *flags]) == 0
    history = json.loads(summary.read_text())["history"]["train"]
    return [s for s, _ in history], [loss for _, loss in history]


def load(path):
    """``(the model-coordinate state a checkpoint holds as whole tensors, its metadata)``: a file or a
    directory, of the default model and optimizer."""
    from cfx._src.train.model import build_model
    from cfx._src.train.saving import model_state
    cfg = TrainConfig()
    model = build_model(cfg)
    return cfx.checkpoint.load(path, model_state(cfg, model, cfx.eval_shape(model.init, cfx.random.key(0))))


def state(path):
    return load(path)[0]


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """``{"one device" | MESH: (losses of steps 1-8, the final checkpoint)}``."""
    d = tmp_path_factory.mktemp("uninterrupted")
    out = {}
    for name, flags in (("one device", []), (MESH, ["--mesh", MESH])):
        end = d / name.replace(",", "_").replace(" ", "_")
        steps, losses = cli(corpus, d / "s.json", *flags, "--save", str(end))
        assert steps == list(range(1, STEPS + 1))
        out[name] = (losses, end)
    torch.testing.assert_close(torch.tensor(out[MESH][0]), torch.tensor(out["one device"][0]), **TOL)
    assert out[MESH][0] != out["one device"][0]  # the two do differ in rounding: the tolerance is needed
    return out


def resumed(corpus, tmp_path, checkpoint, *flags: str, save: str | None = None) -> list[float]:
    steps, losses = cli(corpus, tmp_path / "resumed.json", "--resume", str(checkpoint), *flags,
                        *(["--save", save] if save else []))
    assert steps == list(range(HALF + 1, STEPS + 1))  # it continues from the checkpoint's step
    return losses


def test_a_one_device_checkpoint_resumes_on_a_mesh(corpus, tmp_path, uninterrupted):
    one, mesh = uninterrupted["one device"][0], uninterrupted[MESH][0]
    ck = tmp_path / "ck"  # one file (a one-device run writes one at any path)
    cli(corpus, tmp_path / "half.json", "--save", str(ck), "--stop-after", str(HALF))
    losses = resumed(corpus, tmp_path, ck, "--mesh", MESH, "--save", str(tmp_path / "end"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(mesh[HALF:]), **TOL)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[HALF:]), **TOL)
    cfx.tree.assert_tree_close(state(tmp_path / "end"), state(uninterrupted[MESH][1]), **TOL)  # moments too
    assert resumed(corpus, tmp_path, ck) == one[HALF:]  # the program that saved it: bitwise
    one_rank = resumed(corpus, tmp_path, ck, "--mesh", "data=1")  # a Plan's step (its clip's norm, its mean)
    torch.testing.assert_close(torch.tensor(one_rank), torch.tensor(one[HALF:]), **TOL)


def test_a_mesh_checkpoint_resumes_on_one_device_and_other_plans(corpus, tmp_path, uninterrupted):
    one, mesh = uninterrupted["one device"][0], uninterrupted[MESH][0]
    ck = tmp_path / "ck"  # a directory of every process's regions
    cli(corpus, tmp_path / "half.json", "--mesh", MESH, "--save", str(ck), "--stop-after", str(HALF))
    assert (ck / "index.json").exists()
    alone = resumed(corpus, tmp_path, ck, save=str(tmp_path / "end.safetensors"))  # no mesh: one device
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(mesh[HALF:]), **TOL)
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(one[HALF:]), **TOL)
    cfx.tree.assert_tree_close(state(tmp_path / "end.safetensors"), state(uninterrupted["one device"][1]), **TOL)
    assert resumed(corpus, tmp_path, ck, "--mesh", MESH) == mesh[HALF:]  # the plan that saved it, bitwise
    other = resumed(corpus, tmp_path, ck, "--mesh", "pipe=2,data=2", "--zero", "1", "--microbatches", "2")
    torch.testing.assert_close(torch.tensor(other), torch.tensor(mesh[HALF:]), **TOL)


@pytest.mark.parametrize("flags", [["--mesh", "data=2", "--zero", "3"],
                                   ["--mesh", "pipe=2,model=2", "--microbatches", "2"]])
def test_a_plans_single_file_is_the_one_device_state(corpus, tmp_path, uninterrupted, flags):
    """``--save FILE.safetensors`` on a mesh: whole tensors in model coordinates, whatever the layout
    (ZeRO-3's flat pieces, a pipe axis's stages), which one device reads as its own state."""
    _, full = cli(corpus, tmp_path / "full.json", *flags)
    ck = tmp_path / "ck.safetensors"
    cli(corpus, tmp_path / "half.json", *flags, "--save", str(ck), "--stop-after", str(HALF))
    alone = resumed(corpus, tmp_path, ck)
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(uninterrupted["one device"][0][HALF:]), **TOL)
    assert resumed(corpus, tmp_path, ck, *flags) == full[HALF:]  # the plan that saved it, bitwise


def test_a_lost_optimizer_state_is_outside_the_tolerance(corpus, tmp_path, uninterrupted):
    """What the tolerance above rules out: the params resumed with a fresh optimizer state."""
    ck = tmp_path / "ck.safetensors"
    cli(corpus, tmp_path / "half.json", "--save", str(ck), "--stop-after", str(HALF))
    saved, meta = load(ck)
    fresh = cfx.tree.map(torch.zeros_like, saved["opt_state"])
    cfx.checkpoint.save(tmp_path / "lost.safetensors", {"params": saved["params"], "opt_state": fresh}, metadata=meta)
    lost = resumed(corpus, tmp_path, tmp_path / "lost.safetensors")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(lost), torch.tensor(uninterrupted["one device"][0][HALF:]), **TOL)


def test_a_checkpoint_of_an_earlier_version_resumes_under_todays_names(corpus, tmp_path, uninterrupted):
    """Before every program ran one optimizer, a mesh saved it without the clip's place in the chain
    (``opt_state.0.*``, today ``opt_state.1.*``): the same leaves, read under today's names."""
    from cfx._src.train.model import build_model, build_optimizer
    ck = tmp_path / "ck.safetensors"
    cli(corpus, tmp_path / "half.json", "--save", str(ck), "--stop-after", str(HALF))
    saved, meta = load(ck)
    cfg = TrainConfig()
    model = build_model(cfg)
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    older = cfx.eval_shape(build_optimizer(cfg, model, clip_slot=False).init, shapes)
    opt_state = cfx.tree.unflatten(cfx.tree.structure(older), cfx.tree.leaves(saved["opt_state"]))
    cfx.checkpoint.save(tmp_path / "old.safetensors", {"params": saved["params"], "opt_state": opt_state},
                        metadata=meta)
    with pytest.raises(ValueError, match="does not match the template"):  # the names differ
        cfx.checkpoint.load(tmp_path / "old.safetensors", saved)
    one = uninterrupted["one device"][0]
    assert resumed(corpus, tmp_path, tmp_path / "old.safetensors") == one[HALF:]  # bitwise, as from today's
    on_mesh = resumed(corpus, tmp_path, tmp_path / "old.safetensors", "--mesh", MESH)  # a Plan reads it too
    torch.testing.assert_close(torch.tensor(on_mesh), torch.tensor(uninterrupted[MESH][0][HALF:]), **TOL)


@pytest.mark.parametrize("flags, says", [
    (["--preset", "small"], r"the checkpoint has 4 blocks, the model 12 \(it was saved with --preset tiny; this run "
                            r"has --preset small\)"),
    (["--mesh", "data=2", "--preset", "small"], "the checkpoint has 4 blocks, the model 12"),
    (["--model", "llama"], r"the checkpoint has 'params\..*, which the model lacks.*\(it was saved with --model gpt2; "
                           "this run has --model llama\\)"),
    (["--precision", "fp16", "--mesh", MESH], r"the checkpoint's optimizer state has 138 tensors \(.*\) where the "
                                              r"optimizer's has 141 \('opt_state\.growth_tracker'.*--precision fp32; "
                                              "this run has --precision fp16"),
])
def test_another_model_or_optimizer_is_refused_naming_what_differs(corpus, tmp_path, capsys, flags, says):
    ck = tmp_path / "ck"
    cli(corpus, tmp_path / "s.json", "--save", str(ck), "--steps", "1")
    capsys.readouterr()
    assert main([*COMMON, "--data", corpus, "--resume", str(ck), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (fp16 first notes that it is slow on a CPU)
    assert err.startswith(f"error: --resume '{ck}': "), err
    assert re.search(says, err), err
    assert "mesh" in err and "Resume with the --model, --preset and --precision that saved it" in err


@pytest.mark.timeout(300)
def test_under_torchrun_a_plans_file_is_put_together_from_every_process(corpus, tmp_path, uninterrupted):
    """``--save FILE.safetensors`` with one process per rank: each holds only its own ZeRO-3 pieces, and
    process 0 receives the others' to write the whole tensors -- the same file the threads of one process
    write -- which one device resumes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--mesh", "data=2", "--zero", "3", "--stop-after", str(HALF)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "cfx.train",
           *COMMON, "--data", corpus, *flags, "--save", str(tmp_path / "dist.safetensors")]
    proc = subprocess.run(cmd, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli(corpus, tmp_path / "local.json", *flags, "--save", str(tmp_path / "local.safetensors"))
    cfx.tree.assert_tree_close(state(tmp_path / "dist.safetensors"), state(tmp_path / "local.safetensors"),
                               rtol=0, atol=0)
    alone = resumed(corpus, tmp_path, tmp_path / "dist.safetensors")
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(uninterrupted["one device"][0][HALF:]), **TOL)


def test_a_resumed_run_logs_each_step_once(corpus, tmp_path):
    """``--metrics`` after ``--resume``: the steps a killed run logged past its last checkpoint (here
    appended by hand, as such a run leaves them) are dropped, so each step appears once, the resumed
    run's values where both wrote one."""
    ck, metrics = tmp_path / "ck.safetensors", tmp_path / "m.jsonl"
    cli(corpus, tmp_path / "half.json", "--save", str(ck), "--stop-after", str(HALF), "--metrics", str(metrics))
    with open(metrics, "a") as f:  # the lost steps of a run killed after its checkpoint
        f.writelines(json.dumps({"step": s, "loss": 99.0}) + "\n" for s in range(HALF + 1, HALF + 3))
    _, losses = cli(corpus, tmp_path / "end.json", "--resume", str(ck), "--metrics", str(metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records if "loss" in r][HALF:] == losses
    assert [r["step"] for r in records if "eval" in r] == [0, HALF, STEPS]  # each run's first, the last
