"""Atomic safetensors checkpoints of pytrees: ``cfx.checkpoint.save`` / ``load`` -- one file of
whole tensors, or, for ShardedArrays, a directory each process writes its blocks into and any mesh
loads from (``cfx._src.checkpoint_sharded``)."""
from cfx._src.checkpoint import check_writable, load, save

__all__ = ["check_writable", "load", "save"]
