"""Atomic safetensors checkpoints of pytrees: ``cfx.checkpoint.save`` / ``load``."""
from cfx._src.checkpoint import load, save

__all__ = ["load", "save"]
