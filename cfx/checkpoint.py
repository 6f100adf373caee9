"""Atomic safetensors checkpoints of pytrees: ``cfx.checkpoint.save`` / ``load`` -- one file of
whole tensors, or, for ShardedArrays, a directory each process writes its blocks into and any mesh
loads from (``cfx._src.checkpoint.sharded``). ``save(..., async_=True)`` (and ``Program.save``'s)
returns once the state is copied to host memory and writes it in the background: a
``PendingSave``; ``wait()`` waits for the one in flight.

``from_dcp`` / ``to_dcp``: ``torch.distributed.checkpoint`` directories of a torch model (e.g. an
FSDP2 ``fully_shard`` GPT2LMHeadModel) and ``torch.optim.AdamW``, read into and written from a
Plan's state (``cfx._src.plan.dcp``): ``program.load(from_dcp(dir, model, tx), state)``."""
from cfx._src.checkpoint.background import PendingSave, wait
from cfx._src.checkpoint.file import check_writable, load, save
from cfx._src.plan.dcp import from_dcp, to_dcp

__all__ = ["PendingSave", "check_writable", "from_dcp", "load", "save", "to_dcp", "wait"]
