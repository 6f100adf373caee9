"""Where a ZeRO-3 gathered layer's shard comes from (``ShardSource``: the pieces in the params tree; offload's
and placed chunks' sources subclass it) and the autograd function that gathers it (``GatherFn``: the leaves as
views of one gathered buffer forward, their gradients reduce-scattered backward). ``gathered.py`` runs them."""
from __future__ import annotations

import torch

from cfx._src.lax import comm, groups
from cfx._src.mesh import memory
from cfx._src.zero import prefetch
from cfx._src.zero.flat import GroupLayout
from cfx._src.zero.fp8_reduce import reduce_scatter_fp8


class ShardSource:
    """Where a gathered group's shard comes from. This one: the pieces in the params tree."""

    def __init__(self, layout: GroupLayout, axis: str, pieces: list[torch.Tensor], dtype: torch.dtype):
        self.layout, self.axis, self.pieces, self.dtype = layout, axis, pieces, dtype
        self.regathered: torch.Tensor | None = None
        self.deferred = False  # its gradient's reduce-scatter may finish at the end of backward
        self.before: ShardSource | None = None  # gathered just before this one in forward (prefetched after it in backward)
        self._started: tuple | None = None      # a gather started ahead: (rows, done, order)
        self.prefetch = False                    # may its gathers start ahead (Gathered.prefetch)
        self.saved = 0                           # saved tensors of its buffer backward has yet to unpack
        self.fp8_grads = False                   # its gradient reduce-scattered as e5m2 casts (fp8_reduce.py)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.pieces)

    def shard(self, *, backward: bool) -> torch.Tensor:
        del backward
        return torch.cat([p.detach() for p in self.pieces])

    def deliver(self, grad: torch.Tensor) -> tuple:
        return tuple(grad.split(self.layout.pieces))

    def after_forward(self) -> None:
        pass

    def gather(self, *, backward: bool) -> torch.Tensor:
        """The padded leaf-major buffer (n * S,) of the group, all-gathered now (or, prefetched,
        finished now)."""
        started, self._started = self._started, None
        if self.layout.n == 1 and started is None:  # one rank: the shard is the buffer, nothing to copy
            shard = self.shard(backward=backward).detach()
            groups.axes((self.axis,), "cfx.zero.gathered").record("all_gather", shard)
            self.after_gather(backward=backward)
            if shard._base is None:  # a view of a chunk copy is booked as the chunk already
                memory.watch(shard, tier="device", kind="gathered")
            return shard
        rows, done, order = started if started is not None else self._start(backward=backward)
        done()
        if order is not None:
            rows = rows[order]  # (n, S): the n shards, in requested order
        self.after_gather(backward=backward)
        with memory.ops_unwatched():  # booked as "gathered", not as an op output
            # one rank: the row is already the leaf-major buffer (no second gathered-size copy)
            full = rows.reshape(-1) if self.layout.n == 1 else self.layout.full_from_rows(rows)
        memory.watch(full, tier="device", kind="gathered")
        return full

    def _start(self, *, backward: bool) -> tuple:
        return prefetch.start(self.shard(backward=backward), self.axis)

    def after_gather(self, *, backward: bool) -> None:
        pass

    def get_regathered(self) -> torch.Tensor:
        if self.regathered is None:
            self.regathered = self.gather(backward=True)
            prev = self.before
            if prev is not None and prev.prefetch and prev.regathered is None and prev._started is None:
                prev._started = prev._start(backward=True)  # backward needs it next: in flight meanwhile
        return self.regathered


class GatherFn(torch.autograd.Function):
    """Forward: the leaves, as views of one gathered buffer. Backward: their gradients packed
    into rows (n, S) and reduce-scattered (each leaf's gradient arrives alone: no buffer of the
    gathered size per leaf, as slicing one differentiable buffer would allocate)."""

    @staticmethod
    def forward(ctx, src, *inputs):
        ctx.src = src
        ctx.set_materialize_grads(False)
        return tuple(src.layout.leaves_of_full(src.gather(backward=False)))

    @staticmethod
    def backward(ctx, *grads):
        src = ctx.src
        src.regathered = None  # every use of the params in backward is done
        if src._started is not None:  # prefetched but never used (nothing in backward read the params)
            src._started[1]()
            src._started = None
        rows = src.layout.rows_from_leaves(list(grads), dtype=src.dtype)  # (n, S); None -> zeros
        ax = groups.axes((src.axis,), "cfx.zero.gathered")
        if ax.size == 1:  # nothing to reduce: the row is the gradient (no copy of a gathered-size buffer)
            ax.record("reduce_scatter", rows[0])
            return (None,) + src.deliver(rows[0])
        if src.fp8_grads:  # cast to e5m2 and moved by an all-to-all, summed in fp32 (fp8_reduce.py)
            return (None,) + src.deliver(reduce_scatter_fp8(rows, ax).div_(ax.size))
        if not src.deferred:  # the gradient is read at once
            return (None,) + src.deliver(comm.reduce_scatter_blocks(list(rows.unbind(0)), ax).div_(ax.size))
        # the pieces' gradients are returned by the backward (not accumulated into .grad), so
        # they are read only once it is over: the reduce-scatter runs under the backward of the
        # layers before this one and is waited for by a callback the autograd engine runs before
        # backward returns (FSDP's overlap)
        grad, done = comm.reduce_scatter_start(list(rows.unbind(0)), ax)

        def mean() -> None:
            done()
            grad.div_(ax.size)  # the pieces delivered are views of it
        torch.autograd.Variable._execution_engine.queue_callback(mean)
        return (None,) + src.deliver(grad)
