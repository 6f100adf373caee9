"""The training job behind ``python -m cfx.train``: its config, byte-level data, and the loop over a Plan."""
