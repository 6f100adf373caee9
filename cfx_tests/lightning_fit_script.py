"""A Lightning fit of GPT-2 tiny under ``cfx.lightning.Strategy("data=2 zero=3")`` in two processes,
started by Lightning's own launcher (gloo on CPU), for test_lightning.py:

    python -m cfx_tests.lightning_fit_script OUT [popen|fork]

``popen`` (the default, as ``strategy="ddp"``) runs this script again for rank 1 when ``fit`` starts;
``fork`` forks the ranks from this process, which saves rank 1 importing Lightning (the test's
choice: about 7 s on a busy 2-core machine). Rank 0 writes the CSV log (``OUT/metrics.csv``);
every process writes its regions of the final checkpoint (``OUT/ckpt/epoch=0-step=STEPS.ckpt``,
cfx's sharded directory).
"""
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import cfx.lightning
from cfx.train import TrainConfig

CONFIG = dict(steps=4, batch=4, seq=32, eval_every=0, eval_batches=2, sample_bytes=0, progress=False)
PLAN = "data=2 zero=3"


def main(out: str, start_method: str = "popen") -> None:
    cfg = TrainConfig(**CONFIG)
    strategy = cfx.lightning.Strategy(PLAN, start_method=start_method)
    trainer = pl.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=cfg.steps,
                         logger=CSVLogger(out, name="", version=""), log_every_n_steps=1,
                         callbacks=[ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=cfg.steps)],
                         enable_model_summary=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(cfx.lightning.Module.from_config(cfg), cfx.lightning.ByteData.from_config(cfg))


if __name__ == "__main__":
    main(*sys.argv[1:])
