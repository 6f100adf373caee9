"""Serving many requests at once: a paged KV cache (``blocks``, ``paged``), continuous batching
(``scheduler``) and the engine that runs them (``engine``)."""
