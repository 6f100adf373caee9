"""Checkpoints: one safetensors file of a pytree (``file``), sharded directories written per process in model coordinates (``sharded``), and what both share (``io``)."""
