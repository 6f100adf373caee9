"""The warm-up measurement behind ``auto`` placement: non-model device bytes per chunk access.

During the first step the ``Placer`` tracks device memory with ``cfx.memory`` (op outputs included,
``track_ops``) and marks each chunk access. Access ``t`` spans from its placement to the next
access; its *non-model* bytes are the highest device bytes live in that span minus the chunk
bytes resident during it (fixed within the span: chunks move only at access boundaries). So
gathered payloads, activations and gradients in flight all count, as Colossal's memory stats do.
"""
from __future__ import annotations

import contextlib

from cfx._src.mesh import memory
from cfx._src.gemini.policy import WarmupRecord
from cfx._src.mesh.context import current_or_none


class Recorder:
    def __init__(self):
        self.tracker = memory.track()
        ctx = current_or_none()
        self.rank = 0 if ctx is None else ctx.rank
        self.marks: list[tuple[int, int, int]] = []   # (chunk, timeline position, resident chunk bytes)
        self.ends: list[int] = []

    @contextlib.contextmanager
    def tracking(self):
        with self.tracker, self.tracker.track_ops("device", kind="activation"):
            yield

    def _pos(self) -> int:
        return len(self.tracker.timeline("device", rank=self.rank))

    def begin_access(self, chunk: int, resident_bytes: int) -> None:
        self.marks.append((chunk, self._pos(), resident_bytes))

    def end_access(self) -> None:
        if len(self.ends) < len(self.marks):
            self.ends.append(self._pos())

    def record(self, chunk_bytes) -> WarmupRecord:
        tl = [v for _, v in self.tracker.timeline("device", rank=self.rank)]
        non_model = []
        for (_, start, resident), end in zip(self.marks, self.ends):
            span = tl[max(start - 1, 0):max(end, start)] or [0]
            non_model.append(max(0, max(span) - resident))
        return WarmupRecord(tuple((c,) for c, _, _ in self.marks), tuple(non_model), tuple(chunk_bytes))
