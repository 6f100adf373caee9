"""Memory accounting per rank and tier (device / host / nvme): ``with cfx.memory.track() as mem:``."""
from cfx._src.mesh.memory import (
    TIERS,
    MemoryTracker,
    OpWatcher,
    ops_unwatched,
    Token,
    record_alloc,
    record_free,
    track,
    watch,
)

__all__ = ["TIERS", "MemoryTracker", "OpWatcher", "Token", "ops_unwatched", "record_alloc", "record_free", "track", "watch"]
