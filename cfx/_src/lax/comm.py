"""The one collective layer: raw gloo/NCCL collectives on a rank's group, with accounting.

Everything that moves bytes between all the ranks of a group goes through these functions; they
record each call in the active ``comm_stats`` collectors (``groups``). Inputs are never modified
(except a buffer its caller donated to ``all_reduce``, reduced in place); outputs are fresh
tensors, blocks in the *requested* axis order (``groups.Axes``). Under ``torch.compile`` each is an
opaque functional op the running rank executes (below). Messages between two ranks: ``p2p``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from cfx._src.core import donation
from cfx._src.lax.groups import Axes, backend_buffers, copy_back
from cfx._src.mesh.ledger import Call


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
    buf = backend_buffers(out)
    group.wait(group.get().allreduce(buf, opts), call, seq)
    copy_back([out], buf)
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
    buf_in, *buf_outs = backend_buffers(x, *outs)
    work = group.get().allgather([buf_outs], [buf_in])

    def done() -> None:  # holds the buffers the backend reads and writes until it finished
        group.wait(work, call, seq)
        copy_back(outs, buf_outs)
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
    blocks = ax.in_group_order(blocks)  # group rank j receives requested position order.index(j)
    # one (n, ...) input: gloo's reduce-scatter of a list of blocks is its slow path (at 4 ranks on
    # 2 cores, 18 ms where the one-tensor form takes 7-10 ms for 50k-200k-element blocks)
    group = ax.group
    call = Call("reduce_scatter", ax.names, tuple(tuple(b.shape) for b in blocks), blocks[0].dtype)
    seq = group.issue(call)
    rows = _stacked(blocks)  # (n, ...) in group order
    out = torch.empty_like(blocks[0])
    buf_out, buf_rows = backend_buffers(out, rows)
    work = group.get()._reduce_scatter_base(buf_out.view(-1), buf_rows.view(-1))  # (k,) <- (n * k,)

    def done() -> None:  # holds the buffers the backend reads and writes until it finished
        nonlocal buf_rows
        group.wait(work, call, seq)
        copy_back([out], [buf_out])
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
    blocks = ax.in_group_order(blocks)
    shapes = [b.shape for b in blocks]
    if any(s != shapes[0] for s in shapes):
        raise AssertionError("all_to_all blocks must have equal shapes")
    group = ax.group
    call = Call("all_to_all", ax.names, (tuple(shapes[0]),), blocks[0].dtype)
    seq = group.issue(call)
    inp = torch.stack(blocks)  # (N, ...) by destination
    out = torch.empty_like(inp)
    buf_out, buf_in = backend_buffers(out, inp)
    group.wait(group.get().alltoall_base(buf_out, buf_in, [], []), call, seq)
    copy_back([out], [buf_out])
    received = list(out.unbind(0))  # by source group rank
    return received if ax.order is None else [received[j] for j in ax.order]


def all_to_all_rows(x: torch.Tensor, ax: Axes, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
    """Send ``x``'s rows in consecutive blocks of ``send[i]`` rows to requested position ``i``;
    returns the ``sum(recv)`` rows received, ``recv[j]`` from position ``j``, by sender. The sizes
    vary between ranks, so they are host integers and this runs eagerly (``ragged_all_to_all``)."""
    if torch.compiler.is_dynamo_compiling():
        raise ValueError("cfx.lax.ragged_all_to_all: block sizes that differ per rank are host integers a graph "
                         "cannot hold; run this code (expert-parallel dispatch) outside cfx.jit.")
    x = x.detach().contiguous()
    blocks = list(x.split(list(send)))
    ax.record("ragged_all_to_all", *(b for i, b in enumerate(blocks) if i != ax.index))  # what leaves the rank
    if ax.size == 1:
        return x.clone()
    group = ax.group
    # the backend exchanges in group order
    blocks, send, recv = ax.in_group_order(blocks), ax.in_group_order(send), ax.in_group_order(recv)
    call = Call("ragged_all_to_all", ax.names, (("rows", *x.shape[1:]),), x.dtype)
    seq = group.issue(call)
    inp = torch.cat(blocks)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    buf_out, buf_in = backend_buffers(out, inp)
    group.wait(group.get().alltoall_base(buf_out, buf_in, list(recv), list(send)), call, seq)
    copy_back([out], [buf_out])
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
    works = []
    if ax.size > 1:
        group = ax.group
        call = Call("ppermute", ax.names, (tuple(x.shape),), x.dtype, f"perm {sorted(perm)}")
        seq = group.issue(call)
        pg = group.get()
    buf_x, buf_out = backend_buffers(x, out)
    for src, dst in perm:
        if src == ax.index and dst == ax.index:
            out.copy_(x)
        elif src == ax.index:
            works.append(pg.send([buf_x], ax.group_rank(dst), 0))
        elif dst == ax.index:
            works.append(pg.recv([buf_out], ax.group_rank(src), 0))
    for w in works:
        group.wait(w, call, seq)
    if any(dst == ax.index and src != ax.index for src, dst in perm):
        copy_back([out], [buf_out])
    return out


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
