"""Regional compilation: ``cfx.jit(step, compile="blocks")`` compiles a model's repeated block once.

A transformer's blocks are one function over different params: compiling the whole step traces
every block again (compile time grows with depth: 118 s for GPT-2 small on a CPU), while
compiling the block alone gives one graph -- forward and backward -- that every block replays
(torch's compile-a-region recipe; JAX's scan over layers). Under ``compile="blocks"`` the step runs
eagerly, with ``cfx.jit``'s donation, and the models' block loop (``DecoderLM.run_blocks``, through
``block_apply``) calls each distinct block through ``torch.compile(block.apply)``: blocks that are
equal (one configuration, the usual case) share its graph, whatever their number. The embedding,
head, loss and optimizer run eagerly (the fused AdamW is one kernel either way).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import torch

from cfx._src.core import context

_BACKEND = context.Var("cfx-compile-blocks", None)  # (backend, the codes seen) while a compile="blocks" step runs
_COMPILED: dict[Any, Callable] = {}  # (block, backend) -> its compiled apply; equal blocks share one
_LOCK = threading.Lock()


@contextlib.contextmanager
def blocks_compiled(backend: Any, seen: set | None = None) -> Iterator[None]:
    """While inside, ``block_apply`` gives compiled ``apply`` functions (module doc); ``seen`` collects
    the code objects of the blocks' ``apply`` (one per block class)."""
    token = _BACKEND.set((backend, set() if seen is None else seen))
    try:
        yield
    finally:
        _BACKEND.reset(token)


def block_apply(block: Any) -> Callable:
    """``block.apply``, compiled once per distinct block inside ``blocks_compiled``."""
    running = _BACKEND.get()
    if running is None or torch.compiler.is_dynamo_compiling():
        return block.apply
    backend, seen = running
    seen.add(getattr(block.apply, "__func__", block.apply).__code__)
    try:
        key = (block, backend)
        hash(key)
    except TypeError:  # a block that cannot be a key (an unhashable field): its own graph
        key = (id(block), backend)
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = torch.compile(block.apply, backend=backend, dynamic=False)
    return fn


def compiled_blocks() -> int:
    """How many distinct blocks have a compiled ``apply`` (each compiles its forward and backward once)."""
    return len(_COMPILED)



def graphs_made() -> int:
    """Graphs dynamo has made in this process (its ``unique_graphs`` counter): a call's difference is
    what the call compiled."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class CompiledBlocks:
    """One ``cfx.jit(f, compile="blocks")``: its calls run with their blocks compiled, and what they
    compiled counted for its ``stats()`` -- the block classes (``codes``), the graphs dynamo made during
    its calls and the seconds of those calls."""

    def __init__(self, backend: Any):
        self.backend, self.codes = backend, set()
        self.calls, self.graphs, self.seconds = 0, 0, 0.0

    def run(self, call: Callable[[], Any]) -> Any:
        before, t0 = graphs_made(), time.perf_counter()
        with blocks_compiled(self.backend, self.codes):
            out = call()
        self.calls += 1
        made = graphs_made() - before
        if made > 0:
            self.graphs += made
            self.seconds += time.perf_counter() - t0
        return out
