"""cfx inside PyTorch Lightning: a ``Trainer`` fit of GPT-2 tiny on the stdlib corpus under
``cfx.lightning.Strategy`` trains what ``python -m cfx.train`` trains with the same config and seed
-- bitwise under the same plan, on one device and on ``data=2 zero=3`` in two processes started by
Lightning's launcher -- with the CSV logger's one row per step, ``ModelCheckpoint`` writing cfx's
sharded checkpoint and ``fit(ckpt_path=...)`` resuming it bitwise, validation, ``EarlyStopping``,
gradient accumulation and ``"bf16-mixed"``; what the Plan's program cannot honour is refused with a
one-line ValueError naming the alternative."""
import csv
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import cfx  # noqa: E402
import cfx.lightning  # noqa: E402
from cfx._src.lightning.data import Fixed  # noqa: E402
from cfx._src.train.data import sample_batch  # noqa: E402
from cfx._src.train.model import build_model, build_schedule  # noqa: E402
from cfx._src.train.saving import model_state  # noqa: E402
from cfx.train import TrainConfig, train  # noqa: E402
from cfx_tests import lightning_fit_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = pathlib.Path(ROOT) / "docs" / "lightning.md"
CFG = TrainConfig(steps=6, batch=4, seq=32, eval_every=3, eval_batches=2, sample_bytes=0, progress=False)
# resuming in the directory a run saved into is what Lightning's docs show; it warns all the same
RESUME_WARNING = "ignore:Checkpoint directory .* exists and is not empty:UserWarning"
# two half batches' gradients summed against the whole batch's, then 2 AdamW steps in fp32 (params of order
# 0.02-1): measured 6.2e-6 worst over threads 1/2/4 and both xdist layouts; x11
ACCUMULATED_FP32 = dict(rtol=0, atol=7e-5)


def fit(log_dir, cfg=CFG, plan="", *, module=None, data=None, ckpt_path=None, **flags):
    """``(trainer, module)`` after a fit of ``cfg``'s job under ``Strategy(plan)``, logging to CSV in ``log_dir``;
    ``data``: a LightningDataModule or ``(train, val)`` dataloaders (default: ``cfg``'s ``ByteData``)."""
    flags = {"max_steps": cfg.steps, "enable_progress_bar": False, "limit_val_batches": 0, **flags}
    trainer = pl.Trainer(strategy=cfx.lightning.Strategy(plan), devices=1, logger=pl.loggers.CSVLogger(
        log_dir, name="", version=""), log_every_n_steps=1, enable_model_summary=False, **flags)
    module = module or cfx.lightning.Module.from_config(cfg)
    data = data or cfx.lightning.ByteData.from_config(cfg)
    trainer.fit(module, *(data if isinstance(data, tuple) else (data,)), ckpt_path=ckpt_path)
    return trainer, module


def logged(log_dir, name="train_loss"):
    """``[(step, value)]`` of the rows of the CSV log that hold ``name``."""
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return [(int(r["step"]), float(r[name])) for r in csv.DictReader(f) if r.get(name)]


def losses(summary):
    return [loss for _, loss in summary["history"]["train"]]


@pytest.fixture(scope="module")
def reference():
    """``python -m cfx.train``'s run of ``CFG`` on one device (its summary)."""
    return train(CFG)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A one-device fit of ``CFG`` with the progress bar, saving every 3 steps: ``(trainer, module, log dir)``."""
    d = tmp_path_factory.mktemp("uninterrupted")
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=d / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer, module = fit(d, callbacks=[ckpt], enable_progress_bar=True)
    return trainer, module, d


def test_a_fit_on_one_device_is_python_m_cfx_train_bitwise(reference, uninterrupted):
    trainer, module, d = uninterrupted
    rows = logged(d)
    assert [s for s, _ in rows] == list(range(CFG.steps))  # one row per step
    assert [loss for _, loss in rows] == losses(reference)  # bitwise
    schedule = build_schedule(CFG)  # python -m cfx.train's: the lr of each optimizer step
    assert [lr for _, lr in logged(d, "lr")] == [float(schedule(i)) for i in range(CFG.steps)]
    cfx.tree.assert_tree_close(module.params(), reference["params"], rtol=0, atol=0)
    assert trainer.global_step == CFG.steps and "train_loss" in trainer.progress_bar_metrics


@pytest.mark.filterwarnings(RESUME_WARNING)
def test_resume_through_ckpt_path_equals_the_uninterrupted_fit(tmp_path, uninterrupted):
    _, full, d = uninterrupted
    ckpt = tmp_path / "ckpt"
    saving = lambda: [pl.callbacks.ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_top_k=-1)]  # noqa: E731
    fit(tmp_path / "first", callbacks=saving(), max_steps=3)
    half = ckpt / "epoch=0-step=3.ckpt"
    assert {"index.json", "lightning.ckpt"} <= set(os.listdir(half))  # cfx's sharded checkpoint + Lightning's file
    _, resumed = fit(tmp_path / "second", callbacks=saving(), ckpt_path=half)
    assert logged(tmp_path / "first") + logged(tmp_path / "second") == logged(d)  # bitwise, one row per step
    cfx.tree.assert_tree_close(resumed.params(), full.params(), rtol=0, atol=0)
    # the same checkpoint resumes under python -m cfx.train, and under a Plan on a mesh
    assert losses(train(dataclasses.replace(CFG, resume=str(half)))) == [loss for _, loss in logged(d)][3:]
    fit(tmp_path / "plan", plan="data=2 zero=3", callbacks=saving(), ckpt_path=half)
    torch.testing.assert_close(torch.tensor(logged(tmp_path / "plan")), torch.tensor(logged(d)[3:]))


@pytest.mark.timeout(240)
def test_data2_zero3_in_two_processes_is_python_m_cfx_train_bitwise(tmp_path):
    """Lightning's launcher starts the two processes (forked: ``popen``, the default, works the same and
    costs rank 1 an import of Lightning); the CSV log and the sharded checkpoint they wrote hold
    cfx.train's losses and params on the same plan (its ranks threads of one process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "cfx_tests.lightning_fit_script", str(tmp_path), "fork"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = TrainConfig(**lightning_fit_script.CONFIG)
    ref = train(dataclasses.replace(cfg, mesh="data=2", zero=3))
    assert logged(tmp_path) == list(enumerate(losses(ref)))
    model = build_model(cfg)
    state, meta = cfx.checkpoint.load(tmp_path / "ckpt" / f"epoch=0-step={cfg.steps}.ckpt",
                                      model_state(cfg, model, cfx.eval_shape(model.init, cfx.random.key(0))))
    cfx.tree.assert_tree_close(state["params"], ref["params"], rtol=0, atol=0)
    assert meta["step"] == cfg.steps and meta["plan"] == lightning_fit_script.PLAN


def test_validation_and_early_stopping(tmp_path, reference):
    """Validation every 3 steps logs cfx.train's eval loss; EarlyStopping stops the fit there."""
    stop = pl.callbacks.EarlyStopping(monitor="val_loss", stopping_threshold=10.0)  # met at the first validation
    trainer, _ = fit(tmp_path, callbacks=[stop], limit_val_batches=None, val_check_interval=CFG.eval_every)
    assert trainer.global_step == CFG.eval_every and stop.stopped_epoch == 0 and trainer.should_stop
    [(step, val)] = logged(tmp_path, "val_loss")
    assert step == CFG.eval_every - 1  # (Lightning logs it at the step that ran last)
    torch.testing.assert_close(val, dict(reference["history"]["eval"])[CFG.eval_every], rtol=1e-6, atol=0)


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    """``accumulate_grad_batches=2`` over half batches takes the whole batches' steps."""
    text = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    halves = [sample_batch(text, cfx.random.key(i), 2, 32) for i in range(4)]
    wholes = [tuple(torch.cat(pair) for pair in zip(*halves[i:i + 2])) for i in (0, 2)]
    model = cfx.models.gpt2("tiny", vocab_size=256)
    module = lambda: cfx.lightning.Module(model, cfx.optim.adamw(1e-3), lr=1e-3)  # noqa: E731
    small, a = fit(tmp_path / "a", module=module(), data=(Fixed(halves), Fixed(halves)), max_steps=2,
                   accumulate_grad_batches=2)
    big, b = fit(tmp_path / "b", module=module(), data=(Fixed(wholes), Fixed(wholes)), max_steps=2)
    assert small.global_step == big.global_step == 2
    cfx.tree.assert_tree_close(a.params(), b.params(), **ACCUMULATED_FP32)
    assert [s for s, _ in logged(tmp_path / "a")] == [0, 1]  # a row per optimizer step


def test_bf16_mixed_is_cfx_trains_bf16_policy(tmp_path):
    cfg = dataclasses.replace(CFG, steps=3, precision="bf16")
    _, module = fit(tmp_path, cfg, precision="bf16-mixed")
    ref = train(cfg)
    assert [loss for _, loss in logged(tmp_path)] == losses(ref)
    cfx.tree.assert_tree_close(module.params(), ref["params"], rtol=0, atol=0)
    assert all(x.dtype == torch.float32 for x in cfx.tree.leaves(module.params()))  # fp32 master params


class Manual(cfx.lightning.Module):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.automatic_optimization = False


class TwoOptimizers(cfx.lightning.Module):
    def configure_optimizers(self):
        return [torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.optim.SGD([torch.zeros(1)], lr=0.1)]


class GradHook(cfx.lightning.Module):
    def on_after_backward(self):
        pass


class HoldsLinear(cfx.lightning.Module):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.head = torch.nn.Linear(2, 2)


class GradCallback(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


class Plain(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        pass

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        pass


@pytest.mark.parametrize("make, flags, says", [
    (Manual, {}, r"manual optimisation is not supported; .* write the update as a cfx.optim transform"),
    (TwoOptimizers, {}, r"configure_optimizers: .* combine several with cfx.optim.chain"),
    (GradHook, {}, r"on_after_backward reaches into torch.nn parameters .*; compute it from the params in the"),
    (HoldsLinear, {}, r"holds torch.nn parameters \('head.weight'\), .* put them in the cfx model's params"),
    (None, {"gradient_clip_val": 1.0}, r"clip in the optimizer transform instead, .*clip_by_global_norm"),
    (None, {"callbacks": [GradCallback()]}, r"callback GradCallback.on_before_optimizer_step acts on torch.nn"),
    (None, {"callbacks": [pl.callbacks.StochasticWeightAveraging(swa_lrs=0.1)]}, r"StochasticWeightAveraging acts on"),
    (None, {"callbacks": [pl.callbacks.LearningRateMonitor()]}, r"LearningRateMonitor: the Module logs 'lr' itself"),
    (None, {"callbacks": [pl.callbacks.GradientAccumulationScheduler({0: 2})]}, r"Trainer\(accumulate_grad_batches=N\)"),
    (lambda *a, **k: Plain(), {}, r"trains a cfx.lightning.Module .*, not Plain; use Lightning's own strategies"),
])
def test_what_the_plan_cannot_honour_is_refused_naming_the_alternative(tmp_path, make, flags, says):
    model = cfx.models.gpt2("tiny", vocab_size=256)
    module = (make or cfx.lightning.Module)(model, cfx.optim.adamw(1e-3))
    with pytest.raises(ValueError, match=says) as info:
        fit(tmp_path, module=module, **flags)
    assert "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "metrics.csv")  # before any step


def test_strategy_arguments_and_flags_are_checked_with_the_trainer(tmp_path):
    assert cfx.lightning.Strategy("data=2", zero=3, remat="blocks").plan == cfx.parallel.Plan.parse(
        "data=2 zero=3 remat=blocks")
    with pytest.raises(ValueError, match=r"has 4 rank\(s\) and the Trainer 2 processes; use devices=4 .* or devices=1"):
        pl.Trainer(strategy=cfx.lightning.Strategy("data=4"), devices=2, accelerator="cpu")
    with pytest.raises(ValueError, match=r"precision='bf16-true'\) has no cfx policy; use .* 'bf16-mixed'"):
        pl.Trainer(strategy=cfx.lightning.Strategy(), precision="bf16-true")
    with pytest.raises(ValueError, match=r"the precision is the Trainer's flag; drop precision=bf16 from the plan"):
        cfx.lightning.Strategy("data=2 precision=bf16")
    with pytest.raises(ValueError, match=r"precision='32-true'\) is cfx's fp32, and the module's TrainConfig has "
                                         r"precision='bf16': make them agree"):
        fit(tmp_path, dataclasses.replace(CFG, precision="bf16"))
    with pytest.raises(ValueError, match=r"runs under its strategy: Trainer\(strategy=cfx.lightning.Strategy"):
        cfx.lightning.Module.from_config(CFG).step((torch.zeros(4, 32, dtype=torch.long),) * 2)


def test_the_docs_run_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, str(DOCS), "exec"), {})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert re.search(r"tensor\([\d.]+\) tensor\([\d.]+\)", capsys.readouterr().out)
