"""cfx inside PyTorch Lightning (``pip install 'cfx[lightning]'``): a Plan as a Lightning strategy.

    import lightning as L
    import cfx.lightning

    cfg = cfx.train.TrainConfig(steps=100, batch=8, seq=64)
    trainer = L.Trainer(strategy=cfx.lightning.Strategy("data=2 zero=3"), devices=2, max_steps=cfg.steps,
                        precision="bf16-mixed")
    trainer.fit(cfx.lightning.Module.from_config(cfg), cfx.lightning.ByteData.from_config(cfg))

``Module(model, tx)`` holds a cfx model and optimizer transform (no torch.nn parameters);
``Strategy(plan, **fields)`` runs the plan's program for each ``training_step``, one process per
rank (``devices=N``) or every rank a thread of one process (``devices=1``), and saves cfx's sharded
checkpoints; ``ByteData`` is ``python -m cfx.train``'s data. See docs/lightning.md.
"""
try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as e:  # an optional extra
    raise ModuleNotFoundError("cfx.lightning needs Lightning: pip install 'cfx[lightning]'.") from e

from cfx._src.lightning.data import ByteData
from cfx._src.lightning.module import Module
from cfx._src.lightning.strategy import Strategy

__all__ = ["ByteData", "Module", "Strategy"]
