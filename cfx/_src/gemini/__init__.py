"""Gemini: chunk-based heterogeneous memory (device / host / NVMe) for parameters.

Parameters are packed in execution order into equal-size chunks (``packing``, ``chunks``); each tensor in a
chunk carries a state checked against a transition table (``states``); chunk payloads live in
tier stores (``store``); placement policies decide which chunks sit on the device (``policy``).
Everything here is single-rank: collectives that gather or reduce chunk shards are the caller's.
"""
