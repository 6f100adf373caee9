"""Atomic safetensors checkpoints of pytrees: ``cfx.checkpoint.save`` / ``load``."""
from cfx._src.checkpoint import check_writable, load, save

__all__ = ["check_writable", "load", "save"]
