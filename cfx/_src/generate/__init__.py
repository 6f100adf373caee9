"""Decoding tokens from a language model: ``cfx.generate`` with a KV cache, and the cache-less byte sampler of the training job."""
