"""Atomic safetensors checkpoints of pytrees: ``cfx.checkpoint.save`` / ``load`` -- one file of
whole tensors, or, for ShardedArrays, a directory each process writes its blocks into and any mesh
loads from (``cfx._src.checkpoint.sharded``)."""
from cfx._src.checkpoint.file import check_writable, load, save

__all__ = ["check_writable", "load", "save"]
