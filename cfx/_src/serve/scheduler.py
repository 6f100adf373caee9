"""Which sequences compute which tokens in the next step: iteration-level (continuous) batching.

Each step has a budget of ``max_batch_tokens`` tokens. The running sequences go first, oldest
first: one token each while decoding, the next chunk of the prompt while prefilling (chunked
prefill: a long prompt runs over several steps, beside the others' decoding). Then waiting
sequences join, first come first served, while the budget, ``max_seqs`` and the free blocks allow;
a sequence starting from scratch first takes the blocks of its prefix that the cache holds
(``BlockAllocator.lookup``) and computes only the rest -- and where its next block is the one a
running prefill fills in this step (requests sharing a prefix arriving together), it waits a step
and takes that block from the cache instead of computing it again.

A sequence gets the blocks its new tokens fall in before it is scheduled. Where none is left, the
youngest running sequence is **preempted by recomputation**: its blocks are given back (those in
the prefix cache stay there, so it often takes them back on resuming) and it waits again, in its
arrival order; resumed, it recomputes its tokens and goes on to produce what it would have. A
sequence about to write into a block another one holds too (the last, partial block of a prompt
its ``n`` samples share) copies it first: ``Schedule.copies``, done by the engine before the step.
"""
from __future__ import annotations

import dataclasses
import math

from cfx._src.serve.blocks import BlockAllocator, block_hash
from cfx._src.serve.request import Sequence, Status


@dataclasses.dataclass
class Schedule:
    """One step: ``rows`` (a sequence, how many of its tokens it computes), block ``copies`` (src, dst)
    to make before it, and the sequences ``preempted`` to make room."""

    rows: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.arrival, seq.index


class Scheduler:
    """First come, first served continuous batching over a ``BlockAllocator`` (module doc)."""

    def __init__(self, blocks: BlockAllocator, *, max_batch_tokens: int, max_seqs: int):
        self.blocks, self.max_batch_tokens, self.max_seqs = blocks, max_batch_tokens, max_seqs
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting.sort(key=_order)

    def schedule(self) -> Schedule:
        out, budget = Schedule(), self.max_batch_tokens
        self.running.sort(key=_order)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.to_compute, budget)
            while not self._make_room(seq, n, out):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.rows.append((seq, n))
                budget -= n
                i += 1
        pending = self._pending_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not out.preempted:
            seq = self.waiting[0]
            if not seq.table and self._take_cached_prefix(seq) in pending:
                self._give_back(seq)  # its next block is being computed: wait a step and take it cached
                break
            n = min(seq.to_compute, budget)
            if not self._make_room(seq, n, out):
                self._give_back(seq)
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.rows.append((seq, n))
            budget -= n
            pending |= self._pending_blocks([seq])
        return out

    def _make_room(self, seq: Sequence, n: int, out: Schedule) -> bool:
        """The blocks ``seq``'s next ``n`` tokens fall in, allocated (its shared partial block copied);
        False, with nothing taken, when the pool cannot give them."""
        bs = self.blocks.block_size
        need = math.ceil((seq.computed + n) / bs) - len(seq.table)
        last = seq.computed // bs
        cow = last < len(seq.table) and self.blocks.refs[seq.table[last]] > 1
        if need + cow > self.blocks.available:
            return False
        if cow:
            new = self.blocks.allocate()
            out.copies.append((seq.table[last], new))
            self.blocks.release([seq.table[last]])
            seq.table[last] = new
        seq.table.extend(self.blocks.allocate() for _ in range(need))
        return True

    def _take_cached_prefix(self, seq: Sequence) -> bytes | None:
        """The cached blocks of ``seq``'s leading full blocks: ``seq`` computes from after them (one
        block short of the whole, so that a token is left to compute and give the next logits).
        Returns the key of its first full block not found (None: none is left)."""
        bs, tokens, parent, missed = self.blocks.block_size, seq.tokens, seq.root, None
        for k in range(len(tokens) // bs):
            key = block_hash(parent, tokens[k * bs:(k + 1) * bs])
            b = self.blocks.lookup(key)
            if b is None:
                missed = key
                break
            seq.table.append(b)
            seq.hashes.append(key)
            parent = key
        if len(seq.table) * bs >= len(tokens):
            self.blocks.release([seq.table.pop()])
            seq.hashes.pop()
        seq.registered, seq.computed = len(seq.table), len(seq.table) * bs
        return missed if self.blocks.prefix_caching else None

    def _pending_blocks(self, seqs: list[Sequence] | None = None) -> set[bytes]:
        """The keys of the blocks the running prefills fill next (a waiting prompt starting with one of
        them waits a step for it rather than computing it twice)."""
        if not self.blocks.prefix_caching:
            return set()
        bs, out = self.blocks.block_size, set()
        for seq in self.running if seqs is None else seqs:
            k = seq.registered
            if seq.to_compute > 1 and (k + 1) * bs <= seq.length:
                out.add(block_hash(seq.key_before(k), seq.tokens[k * bs:(k + 1) * bs]))
        return out

    def _give_back(self, seq: Sequence) -> None:
        """``seq`` back to holding nothing, to compute everything when it next starts."""
        self.blocks.release(seq.table)
        seq.table, seq.hashes, seq.computed, seq.registered = [], [], 0, 0

    def _preempt(self, seq: Sequence, out: Schedule) -> None:
        self.running.remove(seq)
        self._give_back(seq)
        seq.status = Status.WAITING
        out.preempted.append(seq)
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        """``seq`` done (finished or aborted): its blocks given back, out of every queue."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._give_back(seq)
        seq.status = Status.FINISHED

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter ``seq``'s blocks filled since the last call into the prefix cache."""
        bs, tokens = self.blocks.block_size, None
        while seq.registered < min(seq.computed // bs, len(seq.table)):
            k = seq.registered
            tokens = tokens or seq.tokens
            key = block_hash(seq.key_before(k), tokens[k * bs:(k + 1) * bs])
            self.blocks.register(seq.table[k], key)
            seq.hashes.append(key)
            seq.registered += 1
