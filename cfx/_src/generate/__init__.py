"""Decoding tokens from a language model: one rule for picking each token (``pick``), one decode loop
(``decode.decode_steps``) run by ``cfx.generate`` with a KV cache and by the training job's
cache-less byte sampler (``sample.sample_bytes``)."""
