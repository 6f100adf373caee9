"""Gemini: chunk-based heterogeneous memory (device / host / NVMe) with checked tensor states."""
from cfx._src.gemini.chunks import Chunk, Slot
from cfx._src.gemini.packing import ChunkLayout, ChunkSearch, SlotPlace, search_chunk_size
from cfx._src.gemini.policy import (
    AutoPolicy,
    DevicePolicy,
    HostPolicy,
    Step,
    WarmupRecord,
    auto,
    device,
    host,
    plan_auto,
)
from cfx._src.gemini.states import EVENTS, TRANSITIONS, IllegalTransition, TensorState, is_legal, transition
from cfx._src.gemini.store import ChecksumMismatch, DeviceStore, HostStore, NvmeStore, make_stores

__all__ = [
    "AutoPolicy", "ChecksumMismatch", "Chunk", "ChunkLayout", "ChunkSearch", "DevicePolicy", "DeviceStore",
    "EVENTS", "HostPolicy", "HostStore", "IllegalTransition", "NvmeStore", "Slot", "SlotPlace", "Step",
    "TRANSITIONS", "TensorState", "WarmupRecord", "auto", "device", "host", "is_legal", "make_stores",
    "plan_auto", "search_chunk_size", "transition",
]
