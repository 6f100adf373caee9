"""The training job behind ``python -m cfx.train`` (its config, byte-level data, model and optimizer,
one device's program, the loop over a Plan, checkpoints) and the command lines that read its runs
(``cli_train``; ``cli_generate``, which also decodes Hugging Face models)."""
