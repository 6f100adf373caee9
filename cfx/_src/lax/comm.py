"""The one collective layer: raw gloo/NCCL calls on a rank's group, with accounting.

Everything that moves bytes between ranks goes through these functions; they record each call
in the active ``comm_stats`` collectors. Inputs are never modified (except a buffer its caller
donated to ``all_reduce``, reduced in place); outputs are fresh tensors.
Blocks are exchanged in the *requested* axis order: a group is made once per member set in the
mesh's axis order, and ``order`` maps requested positions to group ranks.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from cfx._src.core import context, donation
from cfx._src.mesh import memory
from cfx._src.mesh import context as ctx_lib
from cfx._src.mesh.ledger import Call

_collectors = context.Collectors("cfx_comm_stats")


class Axes:
    """A rank's view of the group over ``axes`` in the requested order (make it with ``axes``).

    The group is made (a rendezvous of its members) when the ``Axes`` is, so that a rank that
    fails later has joined it and its peers fail fast; while ``torch.compile`` traces a rank's
    code an ``Axes`` is pure data about the mesh (names, size, this rank's index) and the group
    is made when the graph first moves bytes (``group=False``).
    """

    def __init__(self, axes: tuple[str, ...], where: str, *, group: bool = True):
        ctx = ctx_lib.current(where)
        self.where = where
        self.names = ctx.mesh.check_axes(axes, where)
        self.ctx = ctx
        self.key = ",".join(self.names)  # how a compiled graph's collective names its axes
        self.size = ctx.mesh.axes_size(self.names)
        self.index = ctx.mesh.index_in(self.names, ctx.coords)  # position in requested order: see index_of
        canon = tuple(a for a in ctx.mesh.axis_names if a in self.names)  # the group's axis order
        self._group = ctx.group(self.names) if group else None
        # order[i]: the group rank of the member at requested position i
        if canon == self.names:
            self.order = None
        else:
            self.order = [self._canon_index(i, canon) for i in range(self.size)]

    @property
    def group(self) -> ctx_lib.Group:
        if self._group is None:
            self._group = self.ctx.group(self.names)
        return self._group

    def _canon_index(self, i: int, canon: tuple[str, ...]) -> int:
        mesh, c = self.ctx.mesh, {}
        for a in reversed(self.names):
            i, c[a] = divmod(i, mesh.shape[a])
        return mesh.index_in(canon, c)

    def record(self, op: str, *ts: torch.Tensor) -> None:
        """Count one collective moving ``ts`` with the active ``cfx.comm_stats`` collectors."""
        collectors = _collectors.active()
        if not collectors:
            return
        numel, nbytes = sum(t.numel() for t in ts), sum(t.numel() * t.element_size() for t in ts)
        for c in collectors:
            c.record(self.ctx.rank, op, self.names, numel, nbytes, ctx_lib.in_backward())


def axes(names: tuple[str, ...], where: str) -> Axes:
    """This rank's ``Axes`` over ``names``; under ``torch.compile`` computed once while tracing and
    kept in the graph as a constant (a rank's code is compiled for that rank, see ``cfx.jit``)."""
    if torch.compiler.is_dynamo_compiling():
        return _axes_while_tracing(tuple(names), where)
    return Axes(tuple(names), where)


@context.constant_result
def _axes_while_tracing(names: tuple[str, ...], where: str) -> Axes:
    return Axes(names, where, group=False)  # run for real by dynamo: reads this thread's rank context


def index_of(ax: Axes) -> int:
    """``ax.index`` for code that computes with it: a graph that reads it while tracing is this
    rank's index (``cfx.jit`` then compiles one per index; ``context.note_axis_index``)."""
    if torch.compiler.is_dynamo_compiling():
        context.note_axis_index(ax.names, ax.index)
    return ax.index


def _backend_buffers(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The buffers handed to the backend: the tensors themselves, or private copies while a
    ``cfx.memory`` tracker is active.

    Gloo signals completion before its worker thread drops its references to the tensors it
    moved, so a buffer (and any storage it shares with the caller) can outlive the call by a
    thread switch. Tracked memory must not depend on thread timing, so under a tracker the
    backend only ever sees untracked copies, and results are copied into tracked tensors.
    """
    if not memory.is_tracking():
        return list(tensors)
    with memory.ops_unwatched():
        return [t.clone() for t in tensors]


def _copy_back(outs: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor]) -> None:
    for o, b in zip(outs, bufs):
        if o is not b:
            o.copy_(b)


def all_reduce(x: torch.Tensor, ax: Axes, op: str = "sum") -> torch.Tensor:
    """The reduction of ``x`` over ``ax``: a fresh tensor, or ``x`` itself, reduced in place, when
    its caller donated it (``cfx._src.core.donation``)."""
    if torch.compiler.is_dynamo_compiling():
        return x.clone() if ax.size == 1 else _all_reduce_op(x, ax.key, op)
    if donation.is_donated(x) and x.is_contiguous() and not x.requires_grad:
        out = x
    else:
        out = x.detach().clone(memory_format=torch.contiguous_format)
    ax.record("all_reduce", out)
    if ax.size == 1:
        return out
    group = ax.group
    call = Call(f"all_reduce[{op}]", ax.names, (tuple(out.shape),), out.dtype)
    seq = group.issue(call)
    opts = dist.AllreduceOptions()
    opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    buf = _backend_buffers(out)
    group.wait(group.get().allreduce(buf, opts), call, seq)
    _copy_back([out], buf)
    return out


def all_gather_blocks(x: torch.Tensor, ax: Axes) -> list[torch.Tensor]:
    """Every member's block, in requested order."""
    return list(all_gather_rows(x, ax).unbind(0))


def all_gather_rows(x: torch.Tensor, ax: Axes) -> torch.Tensor:
    """Every member's block as the rows of one tensor (n, ...), in requested order."""
    if torch.compiler.is_dynamo_compiling():
        return x.clone()[None] if ax.size == 1 else _all_gather_op(x.contiguous(), ax.key, ax.size)
    rows, done = all_gather_rows_start(x, ax)
    done()
    return rows if ax.order is None else rows[ax.order]


def all_gather_rows_start(x: torch.Tensor, ax: Axes) -> tuple[torch.Tensor, Callable[[], None]]:
    """``all_gather_rows`` issued without waiting: ``(rows, done)``, ``rows`` in *group* order
    (index it with ``ax.order`` where that is not None) and filled once ``done()`` returned."""
    x = x.detach().contiguous()
    ax.record("all_gather", x)
    if ax.size == 1:
        return x.clone()[None], _nothing
    group = ax.group
    call = Call("all_gather", ax.names, (tuple(x.shape),), x.dtype)
    seq = group.issue(call)
    rows = x.new_empty((ax.size, *x.shape))
    outs = list(rows.unbind(0))  # the backend writes each member's block straight into its row
    buf_in, *buf_outs = _backend_buffers(x, *outs)
    work = group.get().allgather([buf_outs], [buf_in])

    def done() -> None:  # holds the buffers the backend reads and writes until it finished
        group.wait(work, call, seq)
        _copy_back(outs, buf_outs)
        del buf_outs[:]
    return rows, done


def reduce_scatter_blocks(blocks: Sequence[torch.Tensor], ax: Axes) -> torch.Tensor:
    """Sum over members of ``blocks[i]`` lands on the member at requested position ``i``."""
    if torch.compiler.is_dynamo_compiling():
        return blocks[0].clone() if ax.size == 1 else _reduce_scatter_op([b.contiguous() for b in blocks], ax.key)
    out, done = reduce_scatter_start(blocks, ax)
    done()
    return out


def reduce_scatter_start(blocks: Sequence[torch.Tensor], ax: Axes) -> tuple[torch.Tensor, Callable[[], None]]:
    """``reduce_scatter_blocks`` issued without waiting: ``(out, done)``, where ``out`` holds the
    result once ``done()`` returned (the caller must call it before anything reads ``out``)."""
    blocks = [b.detach().contiguous() for b in blocks]
    ax.record("reduce_scatter", *blocks)
    if ax.size == 1:
        return blocks[0].clone(), _nothing
    if ax.order is not None:  # group rank j receives requested position order.index(j)
        inv = [0] * ax.size
        for i, j in enumerate(ax.order):
            inv[j] = i
        blocks = [blocks[inv[j]] for j in range(ax.size)]
    # one (n, ...) input: gloo's reduce-scatter of a list of blocks is its slow path (at 4 ranks on
    # 2 cores, 18 ms where the one-tensor form takes 7-10 ms for 50k-200k-element blocks)
    group = ax.group
    call = Call("reduce_scatter", ax.names, tuple(tuple(b.shape) for b in blocks), blocks[0].dtype)
    seq = group.issue(call)
    rows = _stacked(blocks)  # (n, ...) in group order
    out = torch.empty_like(blocks[0])
    buf_out, buf_rows = _backend_buffers(out, rows)
    work = group.get()._reduce_scatter_base(buf_out.view(-1), buf_rows.view(-1))  # (k,) <- (n * k,)

    def done() -> None:  # holds the buffers the backend reads and writes until it finished
        nonlocal buf_rows
        group.wait(work, call, seq)
        _copy_back([out], [buf_out])
        buf_rows = None
    return out, done


def _stacked(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(blocks)``, without a copy where the blocks already are the consecutive rows
    of one tensor (ZeRO's gradient rows)."""
    first = blocks[0]
    base = first._base if first._base is not None else first
    n, k = len(blocks), first.numel()
    if (base.is_contiguous() and base.numel() == n * k and first.data_ptr() == base.data_ptr()
            and all(b._base is base and b.is_contiguous() and b.shape == first.shape
                    and b.data_ptr() == first.data_ptr() + i * k * first.element_size()
                    for i, b in enumerate(blocks))):
        return base.view(n, *first.shape)
    return torch.stack(blocks)


def _nothing() -> None:
    pass


def all_to_all_blocks(blocks: Sequence[torch.Tensor], ax: Axes) -> list[torch.Tensor]:
    """Send ``blocks[i]`` to requested position ``i``; returns the blocks received, by sender."""
    if torch.compiler.is_dynamo_compiling():
        return [blocks[0].clone()] if ax.size == 1 else list(_all_to_all_op([b.contiguous() for b in blocks],
                                                                               ax.key).unbind(0))
    blocks = [b.detach().contiguous() for b in blocks]
    ax.record("all_to_all", *blocks)
    if ax.size == 1:
        return [blocks[0].clone()]
    if ax.order is not None:
        inv = [0] * ax.size
        for i, j in enumerate(ax.order):
            inv[j] = i
        blocks = [blocks[inv[j]] for j in range(ax.size)]
    shapes = [b.shape for b in blocks]
    if any(s != shapes[0] for s in shapes):
        raise AssertionError("all_to_all blocks must have equal shapes")
    group = ax.group
    call = Call("all_to_all", ax.names, (tuple(shapes[0]),), blocks[0].dtype)
    seq = group.issue(call)
    inp = torch.stack(blocks)  # (N, ...) by destination
    out = torch.empty_like(inp)
    buf_out, buf_in = _backend_buffers(out, inp)
    group.wait(group.get().alltoall_base(buf_out, buf_in, [], []), call, seq)
    _copy_back([out], [buf_out])
    received = list(out.unbind(0))  # by source group rank
    return received if ax.order is None else [received[j] for j in ax.order]


def all_to_all_rows(x: torch.Tensor, ax: Axes, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
    """Send ``x``'s rows in consecutive blocks of ``send[i]`` rows to requested position ``i``;
    returns the ``sum(recv)`` rows received, ``recv[j]`` from position ``j``, by sender. The sizes
    vary between ranks, so they are host integers and this runs eagerly (``ragged_all_to_all``)."""
    _eager_only("cfx.lax.ragged_all_to_all")
    x = x.detach().contiguous()
    blocks = list(x.split(list(send)))
    ax.record("ragged_all_to_all", *(b for i, b in enumerate(blocks) if i != ax.index))  # what leaves the rank
    if ax.size == 1:
        return x.clone()
    group = ax.group
    if ax.order is not None:  # the backend exchanges in group order
        inv = [0] * ax.size
        for i, j in enumerate(ax.order):
            inv[j] = i
        blocks, send, recv = [blocks[inv[j]] for j in range(ax.size)], [send[inv[j]] for j in range(ax.size)], \
            [recv[inv[j]] for j in range(ax.size)]
    call = Call("ragged_all_to_all", ax.names, (("rows", *x.shape[1:]),), x.dtype)
    seq = group.issue(call)
    inp = torch.cat(blocks)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    buf_out, buf_in = _backend_buffers(out, inp)
    group.wait(group.get().alltoall_base(buf_out, buf_in, list(recv), list(send)), call, seq)
    _copy_back([out], [buf_out])
    if ax.order is None:
        return out
    parts = list(out.split(list(recv)))  # by group rank: back to requested order
    return torch.cat([parts[j] for j in ax.order])


def permute(x: torch.Tensor, ax: Axes, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send to / receive from requested positions per ``perm``; zeros where nothing arrives."""
    if torch.compiler.is_dynamo_compiling():
        return _ppermute_op(x.contiguous(), ax.key, [i for pair in perm for i in pair])
    x = x.detach().contiguous()
    ax.record("ppermute", x)
    out = torch.zeros_like(x)
    to_group = (lambda i: i) if ax.order is None else (lambda i: ax.order[i])
    works = []
    if ax.size > 1:
        group = ax.group
        call = Call("ppermute", ax.names, (tuple(x.shape),), x.dtype, f"perm {sorted(perm)}")
        seq = group.issue(call)
        pg = group.get()
    buf_x, buf_out = _backend_buffers(x, out)
    for src, dst in perm:
        if src == ax.index and dst == ax.index:
            out.copy_(x)
        elif src == ax.index:
            works.append(pg.send([buf_x], to_group(dst), 0))
        elif dst == ax.index:
            works.append(pg.recv([buf_out], to_group(src), 0))
    for w in works:
        group.wait(w, call, seq)
    if any(dst == ax.index and src != ax.index for src, dst in perm):
        _copy_back([out], [buf_out])
    return out


# -- point-to-point -----------------------------------------------------------------------------
# Unlike the collectives above, only the two ranks of a message take part. A send never waits
# for its receiver (it returns a handle to wait on later), so schedules whose ranks send before
# they receive (1F1B's steady state) cannot deadlock; a recv blocks until its message arrived.
# Messages between one pair are matched by ``tag``, so give each in-flight message its own tag.


class Pending:
    """An issued ``send``: ``wait()`` blocks until the payload has left; holds it until then."""

    __slots__ = ("_work", "_payload", "_wait")

    def __init__(self, work, payload: torch.Tensor, wait: Callable):
        self._work, self._payload, self._wait = work, payload, wait

    def wait(self) -> None:
        if self._work is not None:
            self._wait(self._work)
        self._work = self._payload = self._wait = None

    def done(self) -> bool:
        """True once the send completed (never blocks); the payload is released then."""
        if self._work is not None and self._work.is_completed():
            self.wait()
        return self._work is None


def _group_rank(ax: Axes, position: int) -> int:
    return position if ax.order is None else ax.order[position]


def _eager_only(where: str) -> None:
    if torch.compiler.is_dynamo_compiling():
        if where == "cfx.lax.ragged_all_to_all":
            raise ValueError(f"{where}: block sizes that differ per rank are host integers a graph cannot "
                             "hold; run this code (expert-parallel dispatch) outside cfx.jit.")
        raise ValueError(f"{where}: point-to-point messages cannot be compiled (their handles live across "
                         "the graph); run this code (cfx.pipeline's executor) outside cfx.jit.")


def send(x: torch.Tensor, ax: Axes, dst: int, tag: int = 0) -> Pending:
    """Start sending ``x`` to requested position ``dst``; the caller must ``wait()`` the handle."""
    _eager_only("cfx.lax.send")
    assert dst != ax.index and ax.size > 1, "a rank never sends to itself"
    x = x.detach().contiguous()
    ax.record("send", x)
    group, to = ax.group, _group_rank(ax, dst)
    call = Call("message", ax.names, (tuple(x.shape),), x.dtype, f"tag {tag}")
    key, seq = group.issue_message(call, group.rank, to, tag)
    buf, = _backend_buffers(x)
    return Pending(group.get().send([buf], to, tag), buf, lambda work: group.wait(work, call, seq, key))


def recv(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, ax: Axes, src: int,
         tag: int = 0) -> torch.Tensor:
    """A fresh tensor of ``shape``/``dtype`` holding what requested position ``src`` sent with
    ``tag``; blocks until it arrived."""
    out, done = recv_start(shape, dtype, device, ax, src, tag)
    done()
    return out


def recv_start(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, ax: Axes,
               src: int, tag: int = 0) -> tuple[torch.Tensor, Callable[[], None]]:
    """``recv`` posted without waiting: ``(out, done)``, ``out`` holding the message once
    ``done()`` returned. A receive posted early lets the message move while this rank computes
    (gloo moves a message's bytes only once its receive is posted)."""
    _eager_only("cfx.lax.recv")
    assert src != ax.index and ax.size > 1, "a rank never receives from itself"
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    ax.record("recv", out)
    group, frm = ax.group, _group_rank(ax, src)
    call = Call("message", ax.names, (tuple(out.shape),), out.dtype, f"tag {tag}")
    key, seq = group.issue_message(call, frm, group.rank, tag)
    buf, = _backend_buffers(out)
    work = group.get().recv([buf], frm, tag)

    def done() -> None:
        group.wait(work, call, seq, key)
        _copy_back([out], [buf])
    return out, done


# -- inside torch.compile -------------------------------------------------------------------------
# A compiled rank's collectives are these ops: functional (a fresh output, inputs untouched),
# opaque to the compiler, and run by the rank that runs the graph, through the functions above
# (its groups, its accounting). The graph names the axes; the group is the running rank's.


def _axes_at_run(key: str) -> Axes:
    return Axes(tuple(key.split(",")), "a compiled collective")


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.clone() if out is x else out  # a custom op's output never aliases its input


@torch.library.custom_op("cfx::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, axes: str, op: str) -> torch.Tensor:
    return _fresh(all_reduce(x, _axes_at_run(axes), op), x)


@torch.library.custom_op("cfx::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, axes: str, n: int) -> torch.Tensor:
    del n  # the fake's output shape
    return all_gather_rows(x, _axes_at_run(axes))  # (n, ...)


@torch.library.custom_op("cfx::reduce_scatter", mutates_args=())
def _reduce_scatter_op(blocks: list[torch.Tensor], axes: str) -> torch.Tensor:
    return reduce_scatter_blocks(blocks, _axes_at_run(axes))


@torch.library.custom_op("cfx::all_to_all", mutates_args=())
def _all_to_all_op(blocks: list[torch.Tensor], axes: str) -> torch.Tensor:
    return torch.stack(all_to_all_blocks(blocks, _axes_at_run(axes)))  # (n, ...) by sender


@torch.library.custom_op("cfx::ppermute", mutates_args=())
def _ppermute_op(x: torch.Tensor, axes: str, perm: list[int]) -> torch.Tensor:
    return _fresh(permute(x, _axes_at_run(axes), list(zip(perm[::2], perm[1::2]))), x)


@_all_reduce_op.register_fake
def _(x, axes, op):
    return torch.empty_like(x)


@_all_gather_op.register_fake
def _(x, axes, n):
    return x.new_empty((n, *x.shape))


@_reduce_scatter_op.register_fake
def _(blocks, axes):
    return torch.empty_like(blocks[0])


@_all_to_all_op.register_fake
def _(blocks, axes):
    return torch.stack([torch.empty_like(b) for b in blocks])


@_ppermute_op.register_fake
def _(x, axes, perm):
    return torch.empty_like(x)
