"""The training job: loss falls, resume equals an uninterrupted run, precisions run, errors are clear."""
import json
import os

import pytest
import torch

import cfx
from cfx.train import TrainConfig, main, train

SMALL = dict(batch=4, seq=32, eval_every=0, eval_batches=2, progress=False, sample_bytes=0)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


def test_loss_falls_on_the_default_corpus():
    s = train(TrainConfig(steps=40, batch=8, seq=64, eval_every=0, eval_batches=4, progress=False,
                          sample_bytes=20))
    assert s["eval_loss_first"] > 5.0  # ~ln(256) at init
    assert s["eval_loss_last"] < s["eval_loss_first"] - 1.0
    assert s["sample"].startswith("def ") and len(s["sample"].encode("utf-8", "replace")) >= 20


def test_resume_equals_uninterrupted_run(tmp_path, text_file):
    base = dict(SMALL, steps=6, data=text_file, model="llama")
    full = train(TrainConfig(**base, save=str(tmp_path / "full.safetensors")))
    train(TrainConfig(**base, stop_after=3, save=str(tmp_path / "half.safetensors")))
    resumed = train(TrainConfig(**base, resume=str(tmp_path / "half.safetensors"),
                                save=str(tmp_path / "resumed.safetensors")))
    assert resumed["steps"] == 3
    cfx.tree.assert_tree_close(resumed["params"], full["params"])
    _, meta = cfx.checkpoint.load(tmp_path / "resumed.safetensors",
                                  {"params": full["params"], "opt_state": _opt_state_like(base, full["params"])})
    assert meta["step"] == 6


def _opt_state_like(base, params):
    from cfx._src.train.model import build_model, build_optimizer
    cfg = TrainConfig(**base)
    return build_optimizer(cfg, build_model(cfg)).init(params)


@pytest.fixture(scope="module")
def fp32_run(text_file):
    return train(TrainConfig(**SMALL, steps=10, data=text_file))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_and_keeps_fp32_master_params(precision, text_file, fp32_run):
    s = train(TrainConfig(**SMALL, steps=10, data=text_file, precision=precision))
    assert all(x.dtype == torch.float32 for x in cfx.tree.leaves(s["params"]))
    assert s["eval_loss_last"] < s["eval_loss_first"] - 1.0
    assert abs(s["eval_loss_last"] - fp32_run["eval_loss_last"]) < 0.15


def test_cli_prints_summary_and_writes_json(tmp_path, text_file, capsys):
    out = tmp_path / "summary.json"
    assert main(["--steps", "2", "--batch", "2", "--seq", "16", "--data", text_file, "--no-progress",
                 "--json", str(out)]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert json.loads(out.read_text())["steps"] == 2


def test_an_unwritable_save_is_refused_before_step_one(tmp_path, text_file, capsys, monkeypatch):

    from cfx._src.train import loop
    steps = []
    real = loop.data_lib.sample_batch
    monkeypatch.setattr(loop.data_lib, "sample_batch", lambda *a, **k: steps.append(1) or real(*a, **k))
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "ckpt.safetensors"  # under a regular file: no directory can be made there
    if os.geteuid() != 0:  # (root ignores permission bits, so a read-only directory would not do)
        (tmp_path / "ro").mkdir(mode=0o500)
        bad = tmp_path / "ro" / "ckpt.safetensors"
    argv = ["--steps", "3", "--batch", "2", "--seq", "16", "--data", text_file, "--no-progress"]
    assert main([*argv, "--save", str(bad)]) == 2
    assert f"--save '{bad}': cannot write a file there" in capsys.readouterr().err
    assert steps == []  # refused before any batch was drawn
    assert main([*argv, "--save", str(tmp_path)]) == 2
    assert "that is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--schedule", "gpipe"], "--schedule applies to a pipeline: add pipe=N to --mesh"),
    (["--mesh", "data=2", "--microbatches", "2"], "--microbatches applies to a pipeline"),
    (["--mesh", "pipe=2", "--chunks", "3"], "--chunks applies to --schedule interleaved only"),
    (["--remat", "blocks", "--remat-budget", "64MiB"], "--remat-budget applies to --remat auto only"),
    (["--zero", "2"], "--zero needs a mesh with a data axis"),
    (["--mesh", "data=2", "--zero", "3", "--offload", "host", "--offload-budget", "1MiB"],
     "--offload-budget applies to --offload auto only"),
    (["--nvme-dir", "/tmp/x"], "--nvme-dir applies to --offload nvme only"),
    (["--save-every", "5"], "--save-every needs --save PATH"),
    (["--sp", "ulysses"], "--sp needs a mesh: --mesh seq=N"),
])
def test_flags_that_would_be_ignored_are_refused(flags, match, text_file, capsys):
    with pytest.raises(SystemExit) as info:
        main([*flags, "--steps", "1", "--data", text_file, "--no-progress"])
    assert info.value.code == 2
    assert match in capsys.readouterr().err
    with pytest.raises(ValueError, match=match.split(":")[0]):  # a TrainConfig set alike is refused too
        train(TrainConfig(**{**SMALL, "steps": 1, "data": text_file}, **_fields(flags)))


@pytest.mark.parametrize("flags, match", [
    (["--lr", "-1"], "--lr -1.0: the peak learning rate must be a positive number"),
    (["--lr", "nan"], "--lr nan: the peak learning rate must be a positive number"),
    (["--batch", "0"], "--batch 0: must be at least 1"),
    (["--warmup", "-3"], "--warmup -3: must be 0 or more"),
    (["--mesh", "data=2", "--zero", "3", "--offload", "nvme", "--nvme-dir", "/nonexistent-cfx-dir/x"],
     "--nvme-dir /nonexistent-cfx-dir/x: its parent /nonexistent-cfx-dir does not exist"),
])
def test_values_no_run_can_use_are_refused_before_it_starts(flags, match, text_file, capsys):
    with pytest.raises(SystemExit) as info:
        main([*flags, "--steps", "1", "--data", text_file, "--no-progress"])
    assert info.value.code == 2 and match in capsys.readouterr().err
    assert not os.path.exists("/nonexistent-cfx-dir")  # nothing made at the filesystem's root


def _fields(flags):
    out, it = {}, iter(flags)
    for flag in it:
        name, value = flag[2:].replace("-", "_"), next(it)
        out[name] = int(value) if value.isdigit() else value
    return out


def test_the_summary_names_the_whole_strategy(text_file, capsys):
    assert main(["--mesh", "pipe=2", "--schedule", "gpipe", "--microbatches", "2", "--remat", "auto",
                 "--remat-budget", "64MiB", "--steps", "1", "--batch", "4", "--seq", "16", "--data", text_file,
                 "--no-progress", "--sample-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert ("mesh pipe=2; precision fp32; zero 0; offload none; remat auto (budget 64MiB); schedule gpipe, "
            "2 microbatches") in out


def test_cli_reports_bad_input(text_file, capsys):
    assert main(["--preset", "huge", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    assert main(["--seq", "4096", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "--seq 4096 exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--steps", "0"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["gpt2", "llama", "opt"])
def test_mesh_training_tracks_single_device(model, text_file):
    base = dict(SMALL, steps=5, data=text_file, model=model)
    single = train(TrainConfig(**base))
    sharded = train(TrainConfig(**base, mesh="data=2,model=2"))
    torch.testing.assert_close(torch.tensor([l for _, l in sharded["history"]["train"]]),
                               torch.tensor([l for _, l in single["history"]["train"]]), rtol=1e-4, atol=1e-5)


def test_torchrun_without_mesh_trains_data_parallel_and_fp16_on_cpu_says_it_is_slow(monkeypatch):
    from cfx._src.train import loop
    from cfx._src.train.loop import launched_config
    monkeypatch.setattr(loop, "_busy_cores", lambda environ: None)  # (an idle machine: the busy case is below)
    cfg, note = launched_config(TrainConfig(), {"WORLD_SIZE": "4", "RANK": "0"})
    assert cfg.mesh == "data=4" and "4 processes and no --mesh" in note  # not 4 copies of one run
    cfg, note = launched_config(TrainConfig(mesh="data=2,model=2"), {"WORLD_SIZE": "4"})
    assert cfg.mesh == "data=2,model=2" and note is None  # an explicit mesh is kept
    assert launched_config(TrainConfig(), {}) == (TrainConfig(), None)
    _, note = launched_config(TrainConfig(precision="fp16"), {})
    assert "fp16 on the CPU" in note and "bf16" in note


def test_a_busy_machine_trains_with_one_thread_unless_told(monkeypatch):
    # make demo took 12 minutes on a loaded 2-core box: it said --threads 1 was ~5x faster and kept 2
    from cfx._src.train import loop
    monkeypatch.setattr(loop.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(loop.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(loop.torch, "get_num_threads", lambda: 2)
    cfg, note = loop.launched_config(TrainConfig(), {})
    assert cfg.threads == 1 and "training with 1 intra-op thread, not 2" in note
    assert loop.launched_config(TrainConfig(threads=2), {}) == (TrainConfig(threads=2), None)  # chosen: kept


def test_fp16_cli_run_prints_the_note(text_file, capsys):
    assert main(["--steps", "1", "--batch", "2", "--seq", "16", "--data", text_file, "--no-progress",
                 "--precision", "fp16", "--eval-every", "0", "--sample-bytes", "0"]) == 0
    assert "fp16 on the CPU" in capsys.readouterr().err


def test_mesh_flag_errors(text_file, capsys):
    assert main(["--mesh", "data=2,experts=2", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "AXIS=SIZE" in capsys.readouterr().err
    assert main(["--mesh", "pipe=2", "--microbatches", "3", "--steps", "1", "--data", text_file,
                 "--no-progress"]) == 2
    assert "microbatches" in capsys.readouterr().err
    assert main(["--mesh", "data=3", "--batch", "4", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "batch of 4 rows does not split over data=3" in capsys.readouterr().err


def test_sequence_parallel_flag_errors(text_file, capsys):
    assert main(["--mesh", "seq=4", "--seq", "12", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "sequences of 12 positions do not split over seq=4" in capsys.readouterr().err
    assert main(["--mesh", "data=2", "--sp", "ring", "--steps", "1", "--data", text_file, "--no-progress"]) == 2
    assert "add seq=N to the mesh" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,schedule", [("pipe=2,data=2", "1f1b"), ("pipe=2,model=2", "zb-h1"),
                                           ("pipe=2", "interleaved")])
def test_pipeline_training_tracks_single_device(mesh, schedule, text_file):
    base = dict(SMALL, steps=3, data=text_file)
    single = train(TrainConfig(**base))
    piped = train(TrainConfig(**base, mesh=mesh, schedule=schedule, microbatches=2))
    torch.testing.assert_close(torch.tensor([l for _, l in piped["history"]["train"]]),
                               torch.tensor([l for _, l in single["history"]["train"]]), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("remat,mesh", [("blocks", None), ("dots", None), ("blocks", "data=2,model=2"),
                                        ("auto", None), ("auto", "pipe=2")])  # once refused naming a library call
def test_remat_flag_keeps_the_loss_trajectory(remat, mesh, text_file):
    base = dict(SMALL, steps=3, data=text_file)
    ref = train(TrainConfig(**base))
    got = train(TrainConfig(**base, remat=remat, mesh=mesh))
    torch.testing.assert_close(torch.tensor([l for _, l in got["history"]["train"]]),
                               torch.tensor([l for _, l in ref["history"]["train"]]), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [dict(mesh="data=2,model=2", zero=1), dict(mesh="pipe=2,data=2", zero=2, microbatches=2),
                                   dict(mesh="data=2", remat="auto", remat_budget="64MiB"),
                                   dict(mesh="data=2,model=2", zero=3, remat="blocks"),
                                   dict(mesh="pipe=2,data=2", zero=3, microbatches=2, offload="auto",
                                        offload_budget="64MiB"),
                                   dict(mesh="seq=4"), dict(mesh="data=2,seq=2", sp="ulysses", zero=1),
                                   dict(mesh="model=2", sp="megatron", sample_bytes=8)])
def test_strategy_flags_keep_the_loss_trajectory(flags, text_file):
    base = dict(SMALL, steps=3, data=text_file)  # AdamW decays matrices only: a mask by leaf, under ZeRO too
    ref = train(TrainConfig(**base))
    got = train(TrainConfig(**{**base, **flags}))
    torch.testing.assert_close(torch.tensor([l for _, l in got["history"]["train"]]),
                               torch.tensor([l for _, l in ref["history"]["train"]]), rtol=1e-4, atol=1e-5)
    cfx.tree.assert_tree_close(got["params"], ref["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_pipe_plan_resumes_its_own_checkpoint(tmp_path, text_file):
    base = dict(SMALL, steps=4, data=text_file, mesh="pipe=2,model=2", microbatches=2, sample_bytes=8)
    full = train(TrainConfig(**base))
    assert full["sample"].startswith("def ")
    train(TrainConfig(**base, stop_after=2, save=str(tmp_path / "half.safetensors")))
    resumed = train(TrainConfig(**base, resume=str(tmp_path / "half.safetensors")))
    cfx.tree.assert_tree_close(resumed["params"], full["params"])


@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_bitwise_and_onto_another_mesh(tmp_path, text_file):
    base = dict(SMALL, steps=4, data=text_file, mesh="data=2,model=2")
    full = train(TrainConfig(**base))
    train(TrainConfig(**base, stop_after=2, save=str(tmp_path / "half")))
    assert (tmp_path / "half" / "index.json").exists()  # a directory of every process's blocks
    same = train(TrainConfig(**base, resume=str(tmp_path / "half")))
    assert same["history"]["train"] == full["history"]["train"][2:]  # bitwise: the same losses
    cfx.tree.assert_tree_close(same["params"], full["params"], rtol=0, atol=0)
    other = train(TrainConfig(**dict(base, mesh="model=4"), resume=str(tmp_path / "half")))
    cfx.tree.assert_tree_close(other["params"], full["params"], rtol=1e-4, atol=1e-5)



@pytest.mark.timeout(400)
def test_a_zero3_checkpoint_resumes_on_other_meshes_stages_and_one_rank(tmp_path, text_file):
    base = dict(SMALL, steps=4, data=text_file, mesh="data=4", zero=3)
    full = train(TrainConfig(**base))
    train(TrainConfig(**base, stop_after=2, save=str(tmp_path / "zero3")))
    for mesh, more in [("data=2,model=2", dict(zero=1)), ("pipe=2,data=2", dict(zero=0, microbatches=2)),
                       ("data=1", dict(zero=0))]:
        other = train(TrainConfig(**dict(base, mesh=mesh, **more), resume=str(tmp_path / "zero3")))
        assert other["steps"] == 2
        cfx.tree.assert_tree_close(other["params"], full["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_zero3_plan_resumes_and_samples(tmp_path, text_file):  # its state in files (offload=nvme)
    base = dict(SMALL, steps=4, data=text_file, mesh="data=2,model=2", zero=3, sample_bytes=8, offload="nvme",
                nvme_dir=str(tmp_path / "nvme"))
    full = train(TrainConfig(**base))
    for half in ("half.safetensors", "half"):  # one file of global tensors; every process's regions
        train(TrainConfig(**base, stop_after=2, save=str(tmp_path / half)))
        resumed = train(TrainConfig(**base, resume=str(tmp_path / half)))
        cfx.tree.assert_tree_close(resumed["params"], full["params"])
        assert resumed["sample"] == full["sample"] and full["sample"].startswith("def ")


def test_strategy_flag_errors_come_before_any_rank(text_file, capsys):
    common = ["--steps", "1", "--data", text_file, "--no-progress"]
    assert main(["--mesh", "model=2", "--zero", "1", *common]) == 2
    assert "add data=N to the mesh" in capsys.readouterr().err
    assert main(["--mesh", "data=2", "--offload", "host", *common]) == 2
    assert "needs zero=3" in capsys.readouterr().err
    assert main(["--mesh", "pipe=2,data=2", "--zero", "3", "--offload", "auto", "--offload-budget", "4KiB", *common]) == 2
    assert "offload=auto needs at least" in capsys.readouterr().err
