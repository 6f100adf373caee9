"""``cfx.jit``: a pure pytree function compiled with ``torch.compile`` (inductor), with donation.

::

    @functools.partial(cfx.jit, donate_argnums=(0,))
    def step(state, tokens, targets):
        loss, grads = cfx.value_and_grad(model.loss)(state.params, tokens, targets)
        updates, opt = tx.update(grads, state.opt, state.params)
        return State(cfx.optim.apply_updates(state.params, updates), opt), loss

    state, loss = step(state, tokens, targets)   # the first call per signature compiles
    step.lower(state, tokens, targets).text()    # the captured graph; .compile_seconds

One graph per signature (static arguments by value, the pytree structure of the others, each
tensor's shape, dtype, device and requires_grad; see ``signature``), traced whole
(``fullgraph=True``: a graph break is an error naming the line) with ``cfx.grad`` inside it
(dynamo traces ``torch.autograd.grad``). Each signature compiles its own code object, so
dynamo's cache holds one entry per signature and another compile of the same signature is a
recompile, counted in ``stats()``.

``donate_argnums``: those arguments' tensors are given up to the call. Inside the graph each
output is written into a donated buffer of its shape and dtype (inductor stores the result there
directly: the optimizer's new params and moments take the old ones' memory), and the caller's
donated tensor objects are deleted: using one raises a ``ValueError`` naming the call and leaf.

``compile=False`` runs the same function eagerly with the same donation semantics (cfx's
optimizers then update donated params and moments in place): the fast eager path, and the way to
debug a jitted function with print and pdb.

Inside ``shard_map`` (and ``cfx.jit(shard_map(f))``) the rank threads of a local mesh share one
compiled graph where what its trace read of the rank is the same for them (``jit_ranks``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
import types
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from cfx._src.core import context, donation
from cfx._src.core import tree as tree_util, tree_recurring
from cfx._src.transforms import jit_ranks, jit_signature as signature, jit_tracing as tracing, regional
from cfx._src.mesh import context as ctx_lib


@dataclasses.dataclass(frozen=True)
class JitStats:
    """``compiles``: graphs dynamo holds, every one a compile (a new batch size is a new signature: one
    more compile, said on stderr with the shape that changed); ``recompiles``: graphs beyond one per
    signature (0 when the guards hold); ``signatures``: distinct call signatures seen;
    ``compile_seconds``: the first calls' time (tracing, compiling and one run), summed. Under
    ``compile="blocks"`` a signature is a block class run compiled and ``compiles`` the graphs dynamo
    made during this function's calls (each block configuration, and a recompile, e.g. under
    ``torch.no_grad``; none where another function compiled the same block first)."""

    signatures: int
    compiles: int
    recompiles: int
    calls: int
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A compiled signature: the graph dynamo captured and what it took to compile."""

    name: str
    graph: torch.fx.GraphModule                              # the last graph compiled
    compile_seconds: float
    graph_count: int                                         # graphs dynamo holds (1 unless recompiled)

    def text(self) -> str:
        """The captured graph as Python code (one line per torch op)."""
        return self.graph.code

    def __repr__(self) -> str:
        ops = sum(1 for n in self.graph.graph.nodes if n.op == "call_function" or n.op == "call_method")
        return (f"Lowered({self.name}: {ops} ops in {self.graph_count} graph(s), compiled in "
                f"{self.compile_seconds:.2f} s)")


class Jitted:
    """``fn`` compiled per call signature; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], *, donate_argnums: int | Sequence[int] = (),
                 static_argnums: int | Sequence[int] = (), backend: str | Callable = "inductor",
                 compile: bool | str = True, verbose: bool = True, dynamic: bool = False):
        if compile not in (True, False, "blocks"):
            raise ValueError(f"cfx.jit: compile must be True (the whole function), 'blocks' (each distinct block "
                             f"once, the rest eager) or False, got {compile!r}.")
        self.fn = fn
        self.verbose = verbose
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.donate = signature.argnums(self.name, "donate_argnums", donate_argnums)
        self.static = signature.argnums(self.name, "static_argnums", static_argnums)
        if set(self.donate) & set(self.static):
            raise ValueError(f"cfx.jit({self.name}): argument(s) {sorted(set(self.donate) & set(self.static))} "
                             "are both static and donated; a static argument is a value of the graph, not "
                             "a buffer. Drop one of the two.")
        if not isinstance(dynamic, bool):
            raise ValueError(f"cfx.jit({self.name}): dynamic must be True (one graph for every size of the "
                             f"arguments) or False (a graph per shape), got {dynamic!r}.")
        self.backend, self.compile, self.dynamic = backend, compile, dynamic
        self._entries = jit_ranks.Entries()  # one per signature, shared by rank threads where they can
        self._last: list = []  # the last eager call's argument structures (``signature.split``)
        self._outs = tree_recurring.Recurring()  # the outputs' structure, the same every step
        self._last_compiled: list | None = None  # the last compiled call's (where, shape, dtype) per tensor
        self._blocks = regional.CompiledBlocks(backend)  # compile="blocks": its calls and what they compiled
        functools.update_wrapper(self, fn)

    # -- calling ---------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        call = signature.split(self.name, args, kwargs, static=self.static, donate=self.donate,
                               keyed=self.compile is True, last=self._last, shapes=not self.dynamic)
        if not self.compile:
            return self._eager(call)
        if self.compile == "blocks":  # regional: the blocks compiled, the rest eager (``regional``)
            return self._blocks.run(lambda: self._eager(call))
        self._check_context()
        entry = self._entry(call)
        first = not entry.traced.is_set()  # this thread compiles it
        t0 = time.perf_counter()
        if first:
            context.reads_reset()  # what the trace reads of this rank (see jit_ranks.Recorder)
            self._say(f"compiling a new signature (graph {len(self._entries)}){self._why_again(call)}; the first "
                      "call takes a while")
        try:
            with tracing.around_call(self.name):
                out = entry.run(*call.dynamic, **call.kwargs)
        finally:
            entry.traced.set()  # a failed trace too: no rank waits for it forever
        if first:
            entry.compile_seconds = time.perf_counter() - t0
            self._say(f"compiled in {entry.compile_seconds:.1f} s")
        entry.calls += 1
        return self._finish(call, out, entry)

    def _why_again(self, call: signature.Call) -> str:
        """What this signature changes from the last one compiled (``signature.what_changed``)."""
        now = [(call.where(i), tuple(t.shape), t.dtype) for i, t in enumerate(call.tensors)]
        last, self._last_compiled = self._last_compiled, now
        return "" if last is None else ": " + signature.what_changed(last, now)

    def _say(self, what: str) -> None:
        """A line on stderr while compiling (``verbose=False`` silences it), from one rank of a mesh."""
        ctx = ctx_lib.current_or_none()
        if self.verbose and (ctx is None or ctx.rank == 0):
            print(f"cfx.jit({self.name}): {what}", file=sys.stderr, flush=True)

    def _check_context(self) -> None:
        inside = context.semantic_set()
        if inside:
            raise ValueError(f"cfx.jit({self.name}) was called inside {' and '.join(inside)}, whose context "
                             "would be baked into the compiled graph; compiling there is not supported. Take the "
                             "gradient inside the shard_map body (a body differentiated from outside tracks "
                             "varying axes per op), or run it there with cfx.jit(..., compile=False), which "
                             "keeps the donation.")

    def _entry(self, call: signature.Call) -> jit_ranks.Entry:
        """This call's compiled entry, shared with the other rank threads where it can be."""
        return self._entries.get(call.key, call.tensors, lambda: self._build(call))

    def _build(self, call: signature.Call) -> jit_ranks.Entry:
        fn, statics, n, graphs = self.fn, call.statics, len(call.args), []
        donate = {i % n for i in self.donate}

        def traced(*dyn, **kwargs):  # the dynamic arguments as pytrees: dynamo guards their structure
            it = iter(dyn)
            args = [statics[i] if i in statics else next(it) for i in range(n)]
            out = fn(*args, **kwargs)
            bufs = [t for i in sorted(donate) for t in tree_util.leaves(args[i])]
            if not bufs:
                return out
            outs, treedef = tree_util.flatten(out)
            fits = lambda i, j: _fits(outs[i], bufs[j])  # noqa: E731
            for i, j in donation.assign(outs, bufs, fits, in_place=False).items():
                outs[i] = bufs[j].copy_(outs[i])  # inductor stores the output straight into the buffer
            return tree_util.unflatten(treedef, outs)

        # A code object of its own per signature: dynamo caches compiled graphs per code object, so
        # signatures never share (or evict) each other's entries, and a second compile is a recompile.
        code = traced.__code__.replace(co_name=f"jit_{self.name}_{len(self._entries)}")
        own = types.FunctionType(code, traced.__globals__, code.co_name, None, traced.__closure__)
        entry = jit_ranks.Entry(None, code, graphs)
        context.mark_constants()  # what the rank context bakes into the graph (cfx._src.core.context)
        backend = jit_ranks.Recorder(self.backend, entry)  # keeps the graphs and what the trace read
        entry.run = torch.compile(own, fullgraph=True, dynamic=self.dynamic, backend=backend)
        return entry

    def _eager(self, call: signature.Call):
        bufs = list(map(call.tensors.__getitem__, call.donated))
        keys = None if call.storages is None else list(map(call.storages.__getitem__, call.donated))
        with donation.donated(bufs, keys=keys) as ids:
            out = self.fn(*call.args, **call.kwargs)
        if not bufs:
            return out
        outs, treedef = self._outs.flatten(out)
        kept = donation.returned_once(outs, bufs, ids)
        if kept is not None:  # an in-place step: each buffer came back as itself, which keeps it
            outs = donation.fresh(outs, kept)  # (and the others detached where they require grad)
            self._delete(call, bufs, held=None)  # (all: none is emptied)
            return tree_util.unflatten(treedef, outs)
        if any(map(getattr, outs, _REQUIRES_GRAD, _FALSE)):  # (one C-level pass, usually all False)
            outs = [x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in outs]
        fits = lambda i, j: _fits(outs[i], bufs[j])  # noqa: E731
        taken = donation.assign(outs, bufs, fits, distinct=True)  # split: no two share a buffer
        outs = donation.write_into(outs, bufs, fits, taken=taken)
        return tree_util.unflatten(treedef, self._release(call, outs, held=taken.values()))

    def _finish(self, call: signature.Call, out: Any, entry: jit_ranks.Entry) -> Any:
        """A compiled call's outputs, after ``_release`` (see there); warns once per signature
        about donated buffers no output took."""
        if not call.donated:
            return out
        outs, treedef = self._outs.flatten(out)
        if not entry.warned:
            entry.warned = True
            held = {x.untyped_storage()._cdata for x in outs if isinstance(x, torch.Tensor)}
            unused = [i for i in call.donated if call.tensors[i].untyped_storage()._cdata not in held]
            if unused:
                warnings.warn(f"cfx.jit({self.name}): {len(unused)} donated buffer(s) were not reused by any "
                              f"output (first: {call.where(unused[0])}); no output has its shape and dtype. "
                              "They are freed, but donating them saves nothing.", stacklevel=3)
        return tree_util.unflatten(treedef, self._release(call, outs))

    def _release(self, call: signature.Call, outs: list, held: Iterable[int] = ()) -> list:
        """The flat outputs, those that are donated input objects made new tensors on the same
        buffers; the donated objects are deleted (their messages are built when first read; those
        whose buffers an output holds, ``held``, are not emptied: see ``donation.delete_all``)."""
        gone = set(map(id, map(call.tensors.__getitem__, call.donated)))
        outs = [x.detach() if id(x) in gone else x for x in outs]
        self._delete(call, [call.tensors[i] for i in call.donated], held=held)
        return outs

    def _delete(self, call: signature.Call, bufs: list, held: Iterable[int] | None) -> None:
        """Delete the call's donated tensors ``bufs`` (``donation.delete_all``; ``held``: the positions
        among them whose buffers outputs hold, None for all)."""
        name, where, donated = self.name, call.where, call.donated  # the message keeps no tensor alive
        donation.delete_all(bufs, lambda k: (
            f"this tensor was donated to {name} ({where(donated[k])}); its buffer now holds that "
            f"call's outputs. Use what {name} returned instead."), held=held)

    # -- inspecting ------------------------------------------------------------------------------
    def lower(self, *args, **kwargs) -> Lowered:
        """Compile for these arguments' signature and return the captured graph and compile time.

        Compiling runs the function once, on copies of the donated arguments: the arguments stay
        usable, and the real call with this signature reuses the compiled graph."""
        if self.compile is not True:
            raise ValueError(f"cfx.jit({self.name}, compile={self.compile!r}) compiles no whole graph; nothing "
                             "to lower.")
        call = signature.split(self.name, args, kwargs, static=self.static, donate=self.donate,
                               shapes=not self.dynamic)
        self._check_context()
        entry = self._entry(call)
        if entry.compile_seconds is None:
            n = len(call.args)
            copy = {i % n for i in self.donate}
            dynamic = [tree_util.map(torch.clone, a) if i in copy else a for i, a in enumerate(call.args)
                       if i not in call.statics]
            t0 = time.perf_counter()
            with tracing.around_call(self.name):
                entry.run(*dynamic, **call.kwargs)
            entry.compile_seconds = time.perf_counter() - t0
        return Lowered(self.name, entry.graphs[-1], entry.compile_seconds, _compiles(entry))

    def stats(self) -> JitStats:
        if self.compile == "blocks":  # a signature per block class; the graphs its calls compiled
            b = self._blocks
            return JitStats(signatures=len(b.codes), compiles=b.graphs, recompiles=max(b.graphs - len(b.codes), 0),
                            calls=b.calls, compile_seconds=b.seconds)
        entries = list(self._entries.values())
        counts = [_compiles(e) for e in entries]
        return JitStats(signatures=len(entries), compiles=sum(counts),
                        recompiles=sum(max(c - 1, 0) for c in counts),
                        calls=sum(e.calls for e in entries),
                        compile_seconds=sum(e.compile_seconds or 0.0 for e in entries))

    def __repr__(self) -> str:
        return f"cfx.jit({self.name}, donate_argnums={self.donate}, static_argnums={self.static})"


def _compiles(entry: jit_ranks.Entry) -> int:
    """How many graphs dynamo holds for this signature (its cache entries; an analysis dynamo
    restarted is not one)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(entry.code))


_REQUIRES_GRAD, _FALSE = itertools.repeat("requires_grad"), itertools.repeat(False)  # getattr's arguments


def _fits(out: Any, buf: torch.Tensor) -> bool:
    return (isinstance(out, torch.Tensor) and out.shape == buf.shape and out.dtype == buf.dtype
            and out.device == buf.device)


def jit(fn: Callable[..., Any] | None = None, *, donate_argnums: int | Sequence[int] = (),
        static_argnums: int | Sequence[int] = (), backend: str | Callable = "inductor",
        compile: bool | str = True, verbose: bool = True, dynamic: bool = False) -> Any:
    """Compile ``fn`` (a pure function of pytrees of tensors) with ``torch.compile``.

    ``donate_argnums``: arguments whose buffers the outputs may take (they are deleted after the
    call). ``static_argnums``: hashable arguments the graph is specialised on. ``backend``: any
    ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces the same graph without
    generating kernels). ``compile=False``: run eagerly with the same donation; ``compile="blocks"``:
    run eagerly but compile each distinct block of the models' block loops once (regional
    compilation, ``cfx._src.transforms.regional``: compile time that does not grow with depth).
    ``verbose``: a line
    on stderr when a new signature compiles and when it is done (a compile takes seconds to
    minutes; ``False`` silences it). ``dynamic=True``: one graph whose sizes are symbols, so a new
    batch size (or sequence length) runs without compiling again -- dynamo still compiles once more
    where code branches on a size (sizes 0 and 1 are specialised; sizes equal to each other at the
    first call are taken as equal, its "duck sizing"), and ``stats()`` counts it; without
    it each new shape is a new signature and compiles (said on stderr, with the size that changed).
    Usable as a decorator, bare or through ``functools.partial``.
    """
    if fn is None:
        return functools.partial(jit, donate_argnums=donate_argnums, static_argnums=static_argnums,
                                 backend=backend, compile=compile, verbose=verbose, dynamic=dynamic)
    if not callable(fn):
        raise ValueError(f"cfx.jit: expected a function, got {type(fn).__name__}.")
    with_body = getattr(fn, "cfx_with_body", None)
    if with_body is not None:  # a shard_map: compile its body, per rank; the boundary moves no data
        body: list[Jitted] = []

        def transform(f):
            body.append(Jitted(f, donate_argnums=donate_argnums, static_argnums=static_argnums, backend=backend,
                               compile=compile, verbose=verbose, dynamic=dynamic))
            return body[0]
        mapped = with_body(transform, body_donates=signature.argnums("jit", "donate_argnums", donate_argnums))
        return JittedShardMap(mapped, body[0])
    return Jitted(fn, donate_argnums=donate_argnums, static_argnums=static_argnums, backend=backend,
                  compile=compile, verbose=verbose, dynamic=dynamic)


class JittedShardMap:
    """``cfx.jit(shard_map(f))``: ``shard_map(cfx.jit(f))``, each rank running its own compiled
    graph of ``f``; ``body`` is the jitted ``f`` (``stats()`` counts every rank's graphs)."""

    def __init__(self, mapped: Callable[..., Any], body: Jitted):
        self._mapped, self.body = mapped, body
        functools.update_wrapper(self, mapped)

    def __call__(self, *args):
        return self._mapped(*args)

    def stats(self) -> JitStats:
        return self.body.stats()

    def __repr__(self) -> str:
        return f"cfx.jit(shard_map({self.body.name}), donate_argnums={self.body.donate})"
