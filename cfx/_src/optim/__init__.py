"""Implementation of ``cfx.optim``; the public names live in ``cfx/optim.py``."""
