"""Named device meshes: the ``local`` (threads) and ``dist`` (torchrun) backends, per-rank contexts, the collective ledger, specs (``P``), spec layout arithmetic and per-rank memory accounting."""
