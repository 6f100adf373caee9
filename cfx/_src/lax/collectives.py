"""Collectives by mesh axis name, each differentiable with JAX's transpose as its backward.

Transposes: psum <-> pvary (psum's backward is the identity, pvary's is a psum),
all_gather <-> psum_scatter, all_to_all <-> all_to_all (split and concat dims swapped),
ppermute <-> ppermute by the inverse permutation; pmax / pmin route the cotangent to the
ranks holding the extremum (split evenly between ties). As in JAX, the cotangent of a psum /
pmean / pmax result (a replicated value) is taken to be the same on every rank, while varying
outputs (all_gather, psum_scatter, all_to_all, ppermute, pvary) have their per-rank cotangents
summed by the transpose.

Each result is tagged with the mesh axes it varies over (``vma``): reductions drop their axes,
the others add them. While a tracking ``shard_map`` body runs (differentiated from outside, or
``check_vma=True``), a differentiable input that does not vary over a collective's axes is first
implicitly ``pvary``'d, as JAX does.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from cfx._src.lax import comm, groups, p2p, vma

Axis = str | Sequence[str]


def _names(axis: Axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _ax(axis: Axis, where: str) -> groups.Axes:
    return groups.axes(_names(axis), where)


def _check_dim(x: torch.Tensor, dim: int, where: str) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"{where}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % max(x.dim(), 1)


def axis_index(axis: Axis) -> int:
    """This rank's position along ``axis`` (tuple axes linearised major to minor)."""
    return groups.index_of(_ax(axis, "cfx.lax.axis_index"))


def axis_size(axis: Axis) -> int:
    """The number of ranks along ``axis`` (the product for a tuple)."""
    return _ax(axis, "cfx.lax.axis_size").size


class _PSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax):
        return comm.all_reduce(x, ax, "sum")

    @staticmethod
    def backward(ctx, g):
        return g, None


class _PExtremum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, op):
        out = comm.all_reduce(x, ax, op)
        ctx.save_for_backward(x, out)
        ctx.ax = ax
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        hit = (x == out).to(g.dtype)
        ties = comm.all_reduce(hit, ctx.ax, "sum")
        return g * hit / ties.clamp_min(1), None, None


def _in(x: torch.Tensor, ax: groups.Axes) -> torch.Tensor:
    """``x`` as a collective over ``ax`` receives it: implicitly pvary'd where a tracking shard_map
    body passes a differentiable value that does not vary over the axes (JAX's rule)."""
    if vma.is_tracking() and x.requires_grad and torch.is_grad_enabled():
        return vma.lift(x, frozenset(ax.names), ax.where)
    return x


def _reduced(out: torch.Tensor, x: torch.Tensor, ax: groups.Axes) -> torch.Tensor:
    return vma.mark(out, vma.varying_axes(x) - set(ax.names)) if vma.is_tracking() else out


def _varying(out: torch.Tensor, x: torch.Tensor, ax: groups.Axes) -> torch.Tensor:
    return vma.mark(out, vma.varying_axes(x) | set(ax.names)) if vma.is_tracking() else out


def psum(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum over the ranks of ``axis``."""
    ax = _ax(axis, "cfx.lax.psum")
    x = _in(x, ax)
    return _reduced(_PSum.apply(x, ax), x, ax)


def pmean(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Mean over the ranks of ``axis``."""
    ax = _ax(axis, "cfx.lax.pmean")
    x = _in(x, ax)
    return _reduced(_PSum.apply(x, ax) / ax.size, x, ax)


def pmax(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Elementwise maximum over the ranks of ``axis``."""
    ax = _ax(axis, "cfx.lax.pmax")
    x = _in(x, ax)
    return _reduced(_PExtremum.apply(x, ax, "max"), x, ax)


def pmin(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Elementwise minimum over the ranks of ``axis``."""
    ax = _ax(axis, "cfx.lax.pmin")
    x = _in(x, ax)
    return _reduced(_PExtremum.apply(x, ax, "min"), x, ax)


def pvary(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Identity on values; marks a replicated value as varying, so its backward sums cotangents.

    Megatron's ``f``: put it where a replicated activation enters a sharded computation.
    """
    ax = _ax(axis, "cfx.lax.pvary")
    already = vma.varying_axes(x) & set(ax.names) if vma.is_tracking() else ()
    if already:  # its transpose would sum cotangents that already differ per rank: wrong gradients
        raise ValueError(f"cfx.lax.pvary: the value already varies over {sorted(already)} (a shard_map input split "
                         "over it, or a collective's result); pvary only the axes it does not vary over yet, "
                         "as in JAX.")
    return _varying(vma.PVary.apply(x, ax), x, ax)


def varying_axes(x: torch.Tensor) -> frozenset:
    """The mesh axes over which ``x`` may differ between ranks (JAX's vma), inside a body that
    tracks them (differentiated from outside, or ``shard_map(..., check_vma=True)``); see ``vma``."""
    return vma.checked_varying_axes(x)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim, tiled):
        ctx.ax, ctx.dim, ctx.tiled = ax, dim, tiled
        blocks = comm.all_gather_blocks(x, ax)
        return torch.cat(blocks, dim) if tiled else torch.stack(blocks, dim)

    @staticmethod
    def backward(ctx, g):
        blocks = g.chunk(ctx.ax.size, ctx.dim) if ctx.tiled else g.unbind(ctx.dim)
        return comm.reduce_scatter_blocks(blocks, ctx.ax), None, None, None


class _PSumScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim, tiled):
        ctx.ax, ctx.dim, ctx.tiled = ax, dim, tiled
        blocks = x.chunk(ax.size, dim) if tiled else x.unbind(dim)
        return comm.reduce_scatter_blocks(blocks, ax)

    @staticmethod
    def backward(ctx, g):
        blocks = comm.all_gather_blocks(g, ctx.ax)
        return (torch.cat(blocks, ctx.dim) if ctx.tiled else torch.stack(blocks, ctx.dim)), None, None, None


def all_gather(x: torch.Tensor, axis: Axis, *, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Every rank's ``x``, stacked along a new ``dim`` (or concatenated along ``dim`` if tiled)."""
    where = "cfx.lax.all_gather"
    ax = _ax(axis, where)
    dim = _check_dim(x, dim, where) if tiled else dim % (x.dim() + 1)
    x = _in(x, ax)
    return _varying(_AllGather.apply(x, ax, dim, tiled), x, ax)


def psum_scatter(x: torch.Tensor, axis: Axis, *, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Sum over ``axis``, then keep this rank's slice of ``dim``: block ``i`` of ``dim`` (tiled) or
    index ``i`` (not tiled, ``x.shape[dim]`` must equal the axis size) goes to position ``i``."""
    where = "cfx.lax.psum_scatter"
    ax = _ax(axis, where)
    dim = _check_dim(x, dim, where)
    n = x.shape[dim] if x.dim() else 1
    if tiled and n % ax.size:
        raise ValueError(f"{where}: dim {dim} has size {n}, not divisible by the {ax.size} ranks of "
                         f"axis {ax.names}; pad it or choose another dim.")
    if not tiled and n != ax.size:
        raise ValueError(f"{where}: with tiled=False dim {dim} must have the axis size {ax.size}, got "
                         f"{n}; pass tiled=True to scatter blocks of it.")
    x = _in(x, ax)
    return _varying(_PSumScatter.apply(x, ax, dim, tiled), x, ax)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, split_dim, concat_dim):
        ctx.ax, ctx.split_dim, ctx.concat_dim = ax, split_dim, concat_dim
        received = comm.all_to_all_blocks(x.chunk(ax.size, split_dim), ax)
        return torch.cat(received, concat_dim)

    @staticmethod
    def backward(ctx, g):
        received = comm.all_to_all_blocks(g.chunk(ctx.ax.size, ctx.concat_dim), ctx.ax)
        return torch.cat(received, ctx.split_dim), None, None, None


def all_to_all(x: torch.Tensor, axis: Axis, *, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``split_dim`` into one block per rank, send block ``i`` to position ``i``, and
    concatenate the blocks received along ``concat_dim`` in sender order."""
    where = "cfx.lax.all_to_all"
    ax = _ax(axis, where)
    split_dim, concat_dim = _check_dim(x, split_dim, where), _check_dim(x, concat_dim, where)
    if x.shape[split_dim] % ax.size:
        raise ValueError(f"{where}: split_dim {split_dim} has size {x.shape[split_dim]}, not divisible "
                         f"by the {ax.size} ranks of axis {ax.names}.")
    x = _in(x, ax)
    return _varying(_AllToAll.apply(x, ax, split_dim, concat_dim), x, ax)


class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, send, recv):
        ctx.ax, ctx.send, ctx.recv = ax, send, recv
        return comm.all_to_all_rows(x, ax, send, recv)

    @staticmethod
    def backward(ctx, g):  # the rows go back where they came from
        return comm.all_to_all_rows(g, ctx.ax, ctx.recv, ctx.send), None, None, None


def ragged_all_to_all(x: torch.Tensor, axis: Axis, send_sizes: torch.Tensor | Sequence[int]
                      ) -> tuple[torch.Tensor, list[int]]:
    """Send ``x``'s rows, in consecutive blocks of ``send_sizes[i]`` rows, to position ``i``;
    returns the rows received, concatenated by sender, and how many came from each.

    The sizes may differ between ranks (an expert-parallel MoE's tokens per expert): each rank
    first learns what it will receive (one equal all-to-all of the sizes, read on the host), then
    the rows move in one variable-size exchange. The transpose sends the cotangent rows back the
    same way. JAX's ``ragged_all_to_all`` names offsets into preallocated buffers instead; here the
    output is allocated to fit. Runs eagerly (the sizes are host integers). ``cfx.comm_stats`` counts
    the rows that leave the rank (op ``"ragged_all_to_all"``) and the sizes' exchange (``"all_to_all"``)."""
    where = "cfx.lax.ragged_all_to_all"
    ax = _ax(axis, where)
    sizes = torch.as_tensor(send_sizes, dtype=torch.int64).to(x.device).reshape(-1)
    if sizes.numel() != ax.size or x.dim() == 0:
        raise ValueError(f"{where}: need one send size per rank of {ax.names} ({ax.size}) and rows to send, "
                         f"got {sizes.numel()} sizes for x of shape {tuple(x.shape)}.")
    send_list = sizes.tolist()
    if sum(send_list) != x.shape[0] or min(send_list) < 0:  # before any collective: no rank waits
        raise ValueError(f"{where}: the send sizes {send_list} must be >= 0 and add up to x's {x.shape[0]} rows.")
    recv = torch.cat(comm.all_to_all_blocks(list(sizes.reshape(ax.size, 1)), ax))  # (n,): what comes from each
    recv_list = recv.tolist()
    x = _in(x, ax)
    return _varying(_RaggedAllToAll.apply(x, ax, tuple(send_list), tuple(recv_list)), x, ax), recv_list


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, perm):
        ctx.ax, ctx.perm = ax, perm
        return comm.permute(x, ax, perm)

    @staticmethod
    def backward(ctx, g):
        return comm.permute(g, ctx.ax, [(d, s) for s, d in ctx.perm]), None, None


def ppermute(x: torch.Tensor, axis: Axis, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` from position ``src`` to ``dst`` for each ``(src, dst)`` in ``perm``; positions
    that receive nothing get zeros. Sources and destinations must each be unique."""
    where = "cfx.lax.ppermute"
    ax = _ax(axis, where)
    perm = [(int(s), int(d)) for s, d in perm]
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    bad = [p for p in srcs + dsts if not 0 <= p < ax.size]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{where}: perm {perm} must pair unique sources with unique destinations in "
                         f"[0, {ax.size}) for axis {ax.names}.")
    x = _in(x, ax)
    return _varying(_PPermute.apply(x, ax, tuple(perm)), x, ax)


def _check_peer(ax: groups.Axes, peer: int, tag: int, where: str, name: str) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < ax.size or peer == ax.index:
        raise ValueError(f"{where}: {name}={peer!r} must be another position of axis {ax.names}, an "
                         f"int in [0, {ax.size}) other than this rank's {ax.index}.")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2 ** 31:
        raise ValueError(f"{where}: tag must be an int in [0, 2**31), got {tag!r}.")


def send(x: torch.Tensor, axis: Axis, *, dst: int, tag: int = 0) -> p2p.Pending:
    """Point-to-point, not differentiable: start sending ``x`` to position ``dst`` of ``axis``.

    Returns a handle; call its ``wait()`` before the end of the step (the send never waits for
    the receiver, so two ranks may each send before they receive). Only ``dst`` takes part: it
    calls ``recv(axis, src=<this position>, tag=tag, ...)``. Callers that need gradients across
    the message send them back explicitly (as ``cfx.pipeline`` does).
    """
    where = "cfx.lax.send"
    ax = _ax(axis, where)
    _check_peer(ax, dst, tag, where, "dst")
    return p2p.send(x, ax, dst, tag)


def recv(axis: Axis, *, src: int, shape: Sequence[int], dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu", tag: int = 0) -> torch.Tensor:
    """Point-to-point, not differentiable: the tensor position ``src`` of ``axis`` sent with
    ``tag`` (of the given ``shape`` and ``dtype``); blocks until it arrives."""
    out, done = recv_start(axis, src=src, shape=shape, dtype=dtype, device=device, tag=tag)
    done()
    return out


def recv_start(axis: Axis, *, src: int, shape: Sequence[int], dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", tag: int = 0) -> tuple[torch.Tensor, Callable[[], None]]:
    """``recv`` posted without waiting: ``(out, done)``; ``out`` holds the message once ``done()``
    returned (call it before reading ``out``, and before the step ends)."""
    where = "cfx.lax.recv"
    ax = _ax(axis, where)
    _check_peer(ax, src, tag, where, "src")
    out, done = p2p.recv_start(shape, dtype, device, ax, src, tag)
    return (vma.mark(out, ax.names) if vma.is_tracking() else out), done
