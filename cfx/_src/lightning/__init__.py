"""cfx inside PyTorch Lightning (the ``lightning`` extra): a cfx model and optimizer as a
LightningModule (``module``), a Plan as a Lightning strategy (``strategy``: the program it runs and
its checkpoints, ``state``; what it refuses and the precision flags, ``checks``), and the training
job's byte-level data as a LightningDataModule (``data``)."""
