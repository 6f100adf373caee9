"""Training on cfx.autoshard's plan: the program's steps (clipped by the global norm across shards)
equal one device's, and ``python -m cfx.train --auto`` tracks the one-device run and refuses the
flags its search decides."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx._src.autoshard.train import AutoProgram, megatron_reference
from cfx.train import TrainConfig, main, train


@pytest.mark.timeout(300)
def test_auto_program_steps_equal_one_device_with_a_global_norm_clip():
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_positions=16, n_embd=32, n_head=4)
    tx = cfx.optim.sgd(0.1, momentum=0.9)
    tokens = cfx.random.randint(cfx.random.key(1), (8, 9), 0, 64)
    batch = (tokens[:, :-1], tokens[:, 1:])
    clipped = cfx.optim.chain(cfx.optim.clip_by_global_norm(0.5), tx)
    params = model.init(cfx.random.key(0))
    state, want = clipped.init(params), []
    for _ in range(3):
        loss, grads = cfx.value_and_grad(model.loss)(params, *batch)
        params, state = cfx.optim.apply_gradients(clipped, grads, state, params)
        want.append(float(loss))
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        # collectives priced at their bytes only: the weights split, so the clip's norm spans shards
        program = AutoProgram(model, tx, mesh, batch=8, seq=8, grad_clip=0.5, cost=cfx.autoshard.CostModel(latency=0))
        assert any(s != cfx.P() for s in program.report.specs.values())
        s, got = program.init(cfx.random.key(0)), []
        for _ in range(3):
            s, metrics = program(s, batch)
            got.append(float(cfx.device_get(metrics["loss"])))
        final = program.params(s)
        assert megatron_reference(model, mesh) is not None
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    cfx.tree.assert_tree_close(final, params)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


@pytest.mark.timeout(300)
def test_train_auto_tracks_one_device_and_prints_its_plan(text_file, capsys):
    base = dict(batch=4, seq=32, eval_every=0, eval_batches=1, progress=False, sample_bytes=0, steps=3,
                data=text_file)
    ref = train(TrainConfig(**base))
    got = train(TrainConfig(**base, mesh="data=2,model=2", auto=True))
    out = capsys.readouterr().out
    assert "cfx.autoshard on mesh {'data': 2, 'model': 2}" in out and "Megatron's plan:" in out
    assert "auto (cfx.autoshard)" in out
    assert "--verbose)" in out and "bytes per rank" not in out  # the summary; the tables behind --verbose
    torch.testing.assert_close(torch.tensor([l for _, l in got["history"]["train"]]),
                               torch.tensor([l for _, l in ref["history"]["train"]]), rtol=1e-4, atol=1e-5)
    cfx.tree.assert_tree_close(got["params"], ref["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags, match", [
    (["--auto"], "--auto searches a plan over a mesh: add --mesh"),
    (["--auto", "--mesh", "data=2", "--zero", "3"], "--zero is decided by --auto's search"),
    (["--auto", "--mesh", "seq=2"], "are schedules"),
    (["--auto", "--mesh", "data=2", "--precision", "bf16"], "--auto searches an fp32 step"),
    (["--auto", "--mesh", "data=2", "--save", "ckpt_dir"], "one .safetensors file"),
    (["--mesh", "data=2", "--auto-budget", "1GiB"], "--auto-budget applies to --auto only"),
])
def test_auto_flag_errors(flags, match, text_file, capsys):
    with pytest.raises(SystemExit) as info:
        main([*flags, "--steps", "1", "--data", text_file, "--no-progress"])
    assert info.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_budget_no_plan_meets_is_refused_before_training(text_file, capsys):
    assert main(["--auto", "--mesh", "data=2", "--auto-budget", "4KiB", "--steps", "1", "--batch", "4", "--seq",
                 "16", "--data", text_file, "--no-progress"]) == 2
    assert "no strategy assignment fits" in capsys.readouterr().err
