"""A Plan with ``tp=2d`` / ``2.5d`` / ``3d``: every block split over the mesh's ``row``, ``col`` (and
``dep``) grid (``cfx.parallel.tensor_parallel_grid``), the batch over ``data``, ZeRO over ``data``.
GPT-2 trains as one device does; a grid plan's checkpoint is the model-coordinate state and loads
onto other plans, grid or not; the combinations not wired are refused before any rank runs; and
``python -m cfx.train --mesh row=2,col=2 --tp 2d`` trains, evaluates and samples."""
from __future__ import annotations

import json

import pytest
import torch

import cfx
from cfx.parallel import Plan
from cfx._src.train.cli_train import main
from cfx._src.train.config import TrainConfig
from cfx._src.train.loop import train

B, T, V = 8, 8, 64
STEPS = 4


def gpt2(**kw):
    return cfx.models.gpt2("tiny", **{**dict(vocab_size=V, n_layer=2, n_embd=32, n_head=4, n_positions=T), **kw})


def batches():
    d = cfx.random.randint(cfx.random.key(1), (STEPS, B, T + 1), 0, V)
    return [(x[:, :-1], x[:, 1:]) for x in d]


def tx():
    return cfx.optim.adamw(1e-3)  # as test_plan: a k bias's ~0 gradient, normalised, stays small


_REFERENCE = {}


def single_device():
    if not _REFERENCE:
        model, opt = gpt2(), tx()
        params = model.init(cfx.random.key(0))
        state, losses = opt.init(params), []
        for x, y in batches():
            loss, g = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
            u, state = opt.update(g, state, params)
            params = cfx.optim.apply_updates(params, u)
            losses.append(float(loss))
        _REFERENCE.update(losses=torch.tensor(losses), params=params)
    return _REFERENCE["losses"], _REFERENCE["params"]


def run(text, steps, *, save=None, load=None, first=0):
    """``(losses, global params)`` after ``steps`` steps of plan ``text`` from batch ``first``, starting
    from ``load`` (a checkpoint directory) or init; ``save``: write the state there after."""
    plan = Plan.parse(text)
    with plan.make_mesh() as mesh:
        program = plan.step(gpt2(), tx(), mesh=mesh)
        state = program.init(cfx.random.key(0))
        if load is not None:
            state, meta = program.load(load, state)
            assert meta["step"] == first
        losses = []
        for batch in batches()[first:first + steps]:
            state, m = program(state, batch)
            losses.append(float(m["loss"]))
        if save is not None:
            program.save(save, state, metadata={"step": steps})
        return torch.tensor(losses), program.params(state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2,row=2,col=2 tp=2d zero=1", "row=2,col=2,dep=2 tp=2.5d",
                                  "row=2,col=2,dep=2 tp=3d", "data=2,row=2,col=2 tp=2d zero=3 remat=blocks"])
def test_a_grid_plan_trains_as_one_device(text):
    plan = Plan.parse(text)
    assert Plan.parse(str(plan)) == plan and plan.tp == text.split("tp=")[1].split()[0]
    ref_losses, ref_params = single_device()
    losses, params = run(text, STEPS)
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(300)
def test_a_grid_checkpoint_loads_onto_other_plans(tmp_path):
    """Saved on a 2D grid with ZeRO-1 (model coordinates: grid blocks, flat optimizer pieces): loaded
    bitwise onto plain ZeRO-3 and onto a 3D cube, each continues one device's trajectory; a 2.5D
    plan's checkpoint loads onto one rank."""
    ref_losses, ref_params = single_device()
    _, saved_params = run("data=2,row=2,col=2 tp=2d zero=1", 2, save=tmp_path / "2d")
    for text in ["data=2 zero=3", "row=2,col=2,dep=2 tp=3d"]:
        _, loaded = run(text, 0, load=tmp_path / "2d", first=2)
        cfx.tree.assert_tree_close(loaded, saved_params, rtol=0, atol=0)
        losses, params = run(text, 2, load=tmp_path / "2d", first=2)
        torch.testing.assert_close(losses, ref_losses[2:])
        cfx.tree.assert_tree_close(params, ref_params)
    run("row=2,col=2,dep=2 tp=2.5d", 2, save=tmp_path / "2.5d")
    losses, _ = run("data=1", 2, load=tmp_path / "2.5d", first=2)
    torch.testing.assert_close(losses, ref_losses[2:])


@pytest.mark.parametrize("text, match", [
    ("row=2,col=2", r"axes \['row', 'col'\] of the mesh .* are a tensor-parallel grid; name its scheme: tp=2d"),
    ("data=2 tp=2d", r"tp=2d splits every block over the axes \('row', 'col'\); the mesh .* has \(\)"),
    ("row=2,col=2 tp=3d", r"tp=3d .* Give the mesh exactly row=N, col=N, dep=N"),
    ("row=2,col=2,dep=2 tp=2d", r"tp=2d .*has \('row', 'col', 'dep'\)"),
    ("row=2,col=4 tp=2d", r"tp=2d needs row = col \(a square grid\).*row=2, col=4"),
    ("row=2,col=2,dep=4 tp=3d", r"row = col = dep \(a cube\)"),
    ("pipe=2,row=2,col=2 tp=2d", r"wired with data parallelism \(and ZeRO\) only, not with the axes \['pipe'\]"),
    ("model=2,row=2,col=2 tp=2d", r"not with the axes \['model'\].*drop model="),
    ("seq=2,row=2,col=2 tp=2d", r"not with the axes \['seq'\]"),
    ("data=2,row=2,col=2 tp=2d zero=3 offload=host", r"tp=2d does not take offload=host"),
    ("row=2,col=2 tp=4d", r"tp='4d'; use one of 2d, 2.5d, 3d"),
])
def test_grid_plans_not_wired_are_refused_by_the_plan(text, match):
    with pytest.raises(ValueError, match=match):
        Plan.parse(text)


def test_a_model_or_batch_the_grid_does_not_split_is_refused_before_any_rank_runs():
    with pytest.raises(ValueError, match=r"Plan 'row=2,col=2 tp=2d', block 0: .*n_heads=3 is not divisible by 2"):
        Plan.parse("row=2,col=2 tp=2d").check(gpt2(n_head=3, n_embd=24))
    with pytest.raises(ValueError, match=r"the loss function .* has none. Drop tp="):
        Plan.parse("row=2,col=2 tp=2d").check(lambda p, x: (p * x).sum(), params=torch.ones(4))
    plan = Plan.parse("data=2,row=2,col=2,dep=2 tp=2.5d")  # each data rank's rows split over dep x row = 4
    with pytest.raises(ValueError, match=r"each data rank's 2 rows do not split over the 4 ranks of the tp=2.5d "
                                         r"grid .* a multiple of 8 rows"):
        plan.check_batch(4, T)


@pytest.mark.timeout(300)
def test_the_cli_trains_on_a_grid_as_on_one_device(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "summary.json"
    common = ["--preset", "tiny", "--batch", "2", "--seq", "16", "--data", str(corpus), "--no-progress"]
    assert main(["--mesh", "row=2,col=2", "--tp", "2d", "--steps", "2", "--eval-batches", "1",
                 "--sample-bytes", "4", "--json", str(out), *common]) == 0
    grid = json.loads(out.read_text())
    one = train(TrainConfig(preset="tiny", batch=2, seq=16, data=str(corpus), progress=False, steps=2,
                            eval_batches=1, sample_bytes=4))
    assert grid["steps"] == 2 and grid["sample"].startswith("def ") and grid["sample"] == one["sample"]
    assert len(grid["history"]["train"]) == 2 and grid["history"]["eval"]
    for kind in ("train", "eval"):  # [step, loss] pairs: the grid's equal one device's
        torch.testing.assert_close(torch.tensor(grid["history"][kind]), torch.tensor(one["history"][kind]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["--mesh", "data=2", "--tp", "2d", "--steps", "1", *common])
    assert info.value.code == 2
    assert "--tp splits every block over the grid axes of --mesh: add row=N,col=N (2d)" in capsys.readouterr().err
    assert main(["--mesh", "row=2,col=2", "--steps", "1", *common]) == 2  # a grid without --tp
    assert "name its scheme: tp=2d" in capsys.readouterr().err
