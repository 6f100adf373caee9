"""The engine in a thread of its own, for a server's event loop: ``EngineThread``.

The engine is not thread-safe; one thread owns it. Callers on any thread (an asyncio server's
handlers) ``submit`` a request and get its id and a ``Stream`` of its outputs; ``abort`` one; and
``close`` the thread. Commands go through an inbox the engine thread drains between steps; each
``StepOutput`` is handed to its request's stream through the stream's own event loop -- a step's
outputs in one ``call_soon_threadsafe`` per loop, not one per token (each call wakes the loop) -- so a
handler awaits tokens as they come. While nothing is unfinished the
thread sleeps on a condition, so an idle server spends no CPU.

``max_waiting`` bounds the requests not yet running (``QueueFull``: a server answers 429); ``close(
drain=True)`` stops taking requests, finishes those in flight and returns (a server's SIGTERM).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

from cfx._src.serve.engine import Engine
from cfx._src.serve.request import SamplingParams, StepOutput


class QueueFull(RuntimeError):
    """More requests wait than ``max_waiting`` allows; retry later."""


class Closed(RuntimeError):
    """The engine thread takes no more requests (it is draining or stopped)."""


@dataclasses.dataclass
class Stream:
    """One request's outputs as they come: ``await stream.get()`` gives each ``StepOutput`` (its
    samples' tokens, interleaved) and None once every sample has finished."""

    request_id: str
    n: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    created: float = dataclasses.field(default_factory=time.perf_counter)

    async def get(self) -> StepOutput | None:
        return await self.queue.get()


class EngineThread:
    """``engine`` stepped by a daemon thread (module doc); ``on_step(engine, outputs, seconds)`` is
    called on that thread after every step (metrics)."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256, on_step: Any = None):
        self.engine, self.max_waiting, self.on_step = engine, max_waiting, on_step
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._streams: dict[str, Stream] = {}
        self._left: dict[str, int] = {}  # samples not finished yet, per request
        self._accepting, self._stopping, self.error = True, False, None
        self._outbox: list[tuple[Stream, Any]] = []  # what the engine thread hands over next (``_flush``)
        self._thread = threading.Thread(target=self._loop, name="cfx-serve-engine", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------------------
    def submit(self, prompt: Any, params: SamplingParams, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        """Queue a request (checked now: a ValueError names what is wrong); its ``Stream``."""
        loop = loop or asyncio.get_running_loop()
        with self._cv:
            if not self._accepting:
                raise Closed("the server is shutting down")
            waiting = len(self.engine.scheduler.waiting) + sum(1 for c in self._inbox if c[0] == "add")
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (max_waiting={self.max_waiting})")
            rid = self.engine.reserve_request(prompt, params)  # checks and takes an id, on the caller's thread
            stream = Stream(rid, params.n, asyncio.Queue(), loop)
            self._streams[rid], self._left[rid] = stream, params.n
            self._inbox.append(("add", rid))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (a client that went away): its blocks are given back at the next step."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take no more requests; ``drain``: finish those in flight first, else abort them; then stop."""
        with self._cv:
            self._accepting = False
            if not drain:
                self._inbox.extend(("abort", rid) for rid in list(self._streams))
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- the engine's thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self.engine.has_unfinished() and not self._stopping:
                        self._cv.wait()
                    inbox, self._inbox = self._inbox, []
                    if self._stopping and not inbox and not self.engine.has_unfinished():
                        return
                for cmd, rid in inbox:
                    if cmd == "add":
                        self.engine.start_request(rid)
                    else:
                        self.engine.abort(rid)
                        self._finish_aborted(rid)
                if self.engine.has_unfinished():
                    t0 = time.perf_counter()
                    outs = self.engine.step()
                    if self.on_step is not None:
                        self.on_step(self.engine, outs, time.perf_counter() - t0)
                    for out in outs:
                        self._deliver(out)
                self._flush()
        except BaseException as e:  # noqa: BLE001 -- every waiting request learns the engine died
            self.error = e
            with self._cv:
                self._accepting = False
                for rid in list(self._streams):
                    self._push(rid, e)
                    self._end(rid)
            self._flush()

    def _deliver(self, out: StepOutput) -> None:
        with self._cv:
            if out.request_id not in self._streams:
                return
            self._push(out.request_id, out)
            if out.finished:
                self._left[out.request_id] -= 1
                if self._left[out.request_id] == 0:
                    self._end(out.request_id)

    def _finish_aborted(self, rid: str) -> None:
        with self._cv:
            if rid in self._streams:
                self._end(rid)

    def _push(self, rid: str, item: Any) -> None:
        self._outbox.append((self._streams[rid], item))

    def _flush(self) -> None:
        """Hand the outbox over: one ``call_soon_threadsafe`` per event loop, its streams' items in order."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for s, item in self._outbox:
            by_loop.setdefault(s.loop, []).append((s.queue, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # a loop closed under its stream (a client's event loop gone): nobody waits
                pass

    def _end(self, rid: str) -> None:
        self._push(rid, None)
        del self._streams[rid], self._left[rid]
        if all(s.finish_reason is not None for s in self.engine.seqs.get(rid, ())):
            self.engine.forget(rid)


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
