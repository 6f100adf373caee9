"""``cfx.jit``'s compiled entries, one per signature, and how the rank threads of a local mesh
share one compiled graph.

Inside ``shard_map`` (and ``cfx.jit(shard_map(f))``, which is ``shard_map(cfx.jit(f))``) the rank
context is read into the trace as constants (axis sizes, and an axis index where code computes
with one), and every collective is an opaque functional op the running rank executes over its own
groups (``lax.comm``). The first rank to call compiles; a rank whose own values of what that trace
read are the same runs the same graph, others compile theirs (``context.reads``): data parallel and
ZeRO-3 compile once per mesh, a vocab-parallel TP head once per ``model`` index.

``Entries`` hands each call its entry (``Entries.get``); ``Recorder``, the compiler backend, keeps
what the trace read and lets the waiting ranks go on once the graph is built.
"""
from __future__ import annotations

import dataclasses
import threading
import types
from typing import Any, Callable, Hashable

import torch
from torch.fx._lazy_graph_module import _force_skip_lazy_graph_module, _use_lazy_graph_module

from cfx._src.core import context
from cfx._src.lax import groups
from cfx._src.mesh import context as ctx_lib


@dataclasses.dataclass
class Entry:
    """One signature's compiled function and what compiling it took."""

    run: Callable[..., Any]
    code: types.CodeType                                     # this signature's own code object
    graphs: list = dataclasses.field(default_factory=list)   # the FX graphs dynamo handed the backend
    compile_seconds: float | None = None                     # the first call: trace, compile, run
    calls: int = 0
    warned: bool = False                                     # about donated buffers no output took
    # inside shard_map: the rank that compiles it, what its graph baked in of that rank
    # (context.reads: ranks with other values compile their own), an event set once known
    owner: int | None = None
    reads: frozenset | None = None
    traced: threading.Event = dataclasses.field(default_factory=threading.Event)


class Entries:
    """A jitted function's entries by key, shared by the threads (ranks) that call it."""

    def __init__(self):
        self._entries: dict[Any, Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[Entry]:
        return list(self._entries.values())

    def get(self, key: Hashable, tensors: list, build: Callable[[], Entry]) -> Entry:
        """The entry of a call keyed ``key`` (its signature) with tensor leaves ``tensors``;
        ``build`` makes a new one. Inside shard_map the first rank to arrive compiles a graph that
        every rank runs, unless its trace baked in values of that rank (an axis index): then the
        ranks whose values differ compile their own, once per distinct set of values."""
        where = ctx_lib.compile_key()
        if where is None:
            return self._get(key, build)
        if any(t.requires_grad for t in tensors):  # differentiated from outside: AOT compiles its
            return self._get((key, where), build)  # backward lazily, on the first call: not shared
        shape, rank = where
        shared = (key, shape)
        while True:
            entry = self._get(shared, build, owner=rank)
            if entry.owner == rank:
                return entry
            entry.traced.wait()
            from torch._dynamo import convert_frame  # dynamo is loaded on first use, not at import
            with convert_frame.compile_lock:  # the owner's graph is in dynamo's cache once this is free
                pass
            if entry.reads is None:  # its trace failed: nothing to share
                return self._get((key, where), build)
            here = context.reads_here(entry.reads, lambda names: groups.axes(names, "cfx.jit").index)
            if here == entry.reads:
                return entry
            shared = (key, shape, here)

    def _get(self, key: Hashable, build: Callable[[], Entry], *, owner: int | None = None) -> Entry:
        """The entry under ``key``, built (compiled by ``owner``, the rank asking) if there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = build()
                entry.owner = owner
            return entry


class Recorder:
    """The compiler backend, keeping each graph dynamo hands it (for ``lower`` and ``stats``) and
    what its trace baked in of the rank compiling it (``context.reads``)."""

    def __init__(self, backend: str | Callable, entry: Entry):
        import torch._dynamo
        self.inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.entry = entry

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.entry.graphs.append(gm)
        self.entry.reads = context.reads()
        try:
            # graph modules with their code generated now, not on the first call: ranks sharing
            # this graph make their first calls at once, and a lazy module's codegen is not
            # thread-safe. Dynamo has turned lazy modules on before calling a backend: turn them
            # off for what this backend builds (aot_eager's graphs) and for what re-enters the
            # switch (inductor's). Compiles hold dynamo's lock, so no other compile sees the flag.
            with _force_skip_lazy_graph_module(), _use_lazy_graph_module(False):
                return self.inner(gm, example_inputs)
        finally:
            self.entry.traced.set()  # the other ranks may go on (before this one runs the graph)
