"""Where each element of a cfx model's params sits in a torch module's state dict, read off the
conversion that already exists (``cfx.models.to_hf``, or any ``params -> state dict`` function).

``TorchNames(model, names)`` runs ``names`` once on *probe* params: float64 leaves numbered
``1, 2, 3, ...`` across the whole tree (exact in float64 up to 2**53 elements), so every element
of every tensor it returns says which cfx leaf and element it came from. Each (torch key, cfx
leaf) pair is then checked to be a ``Piece``: a rectangle of the cfx leaf that is a rectangle of
the torch tensor with its dimensions permuted -- HF's fused ``c_attn`` holds ``q``, ``k``, ``v``
side by side, ``nn.Linear``'s weight is cfx's transposed, a tied ``lm_head`` repeats ``wte``. No
second table of names is written: the model's own conversion is the table, and a region of a cfx
leaf reads as the few rectangles of torch tensors it is made of (``Piece.box``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from cfx._src.core import random as jr
from cfx._src.core import tree as tree_util
from cfx._src.transforms.shapes import eval_shape


class Piece(NamedTuple):
    """Elements ``[lo, lo + size)`` of a cfx leaf are torch ``key``'s box at ``torch_lo``;
    ``dims[j]`` is the torch dimension cfx dimension ``j`` runs along (-1 where ``size[j] == 1``)."""

    key: str
    lo: tuple[int, ...]
    size: tuple[int, ...]
    torch_lo: tuple[int, ...]
    dims: tuple[int, ...]

    def box(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(torch offsets, torch sizes)`` of the cfx elements ``[lo, hi)`` within this piece, or None."""
        lo = tuple(max(a, b) for a, b in zip(lo, self.lo))
        hi = tuple(min(a, b + n) for a, b, n in zip(hi, self.lo, self.size))
        if any(a >= b for a, b in zip(lo, hi)):
            return None
        t_lo, t_size = list(self.torch_lo), [1] * len(self.torch_lo)
        for j, d in enumerate(self.dims):
            if d >= 0:
                t_lo[d] += lo[j] - self.lo[j]
                t_size[d] = hi[j] - lo[j]
        return tuple(t_lo), tuple(t_size)

    def to_cfx(self, t: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
        """A torch box ``t`` (``box``'s) laid out as the cfx rectangle of shape ``size``."""
        mapped = [d for d in self.dims if d >= 0]
        order = mapped + [d for d in range(t.dim()) if d not in mapped]
        return t.permute(order).reshape(size)


def hf_names(model: Any) -> Callable[[Any], dict[str, torch.Tensor]]:
    """``names="hf"``: the Hugging Face model's state dict (``cfx.models.to_hf``)."""
    from cfx._src.models.hf import to_hf

    return lambda params: to_hf(model, params)


class TorchNames:
    """The cfx model's params as pieces of a torch state dict's tensors (module doc).

    ``pieces[path]``: the pieces of cfx leaf ``path`` in the order ``names`` returns the keys
    (tied keys repeat a piece); ``shapes[key]``: each torch tensor's shape; ``keys``: the torch keys,
    ``params``: those a torch module holds as distinct parameters (a tied repeat left out: the key an
    optimizer's state is saved under); ``fn``: the ``params -> state dict`` function itself."""

    def __init__(self, model: Any, names: str | Callable[[Any], Any]):
        self.fn = fn = hf_names(model) if names == "hf" else names
        if not callable(fn):
            raise ValueError(f"cfx.checkpoint: names={names!r}; pass 'hf' (Hugging Face's names, cfx.models.to_hf) "
                             "or a function from the model's params to a torch state dict.")
        items, treedef = tree_util.flatten_with_path(eval_shape(model.init, jr.key(0)))
        self.paths = [p for p, _ in items]
        self.leaf_shapes = {p: tuple(x.shape) for p, x in items}
        starts = [1 + sum(math.prod(x.shape) for _, x in items[:i]) for i in range(len(items))]
        probe = [torch.arange(s, s + math.prod(x.shape), dtype=torch.float64).reshape(x.shape)
                 for s, (_, x) in zip(starts, items)]
        state_dict = dict(fn(tree_util.unflatten(treedef, probe)))
        self.pieces: dict[str, list[Piece]] = {p: [] for p in self.paths}
        self.shapes = {k: tuple(t.shape) for k, t in state_dict.items()}
        self.keys, self.params, seen = list(state_dict), [], set()
        for key, t in state_dict.items():
            found = _pieces(key, t, starts, self.paths, self.leaf_shapes)
            for path, piece in found:
                self.pieces[path].append(piece)
            if not found or any((path, piece.lo, piece.size) not in seen for path, piece in found):
                self.params.append(key)
            seen.update((path, piece.lo, piece.size) for path, piece in found)
        unnamed = [p for p in self.paths if sum(math.prod(q.size) for q in _distinct(self.pieces[p]))
                   != math.prod(self.leaf_shapes[p])]
        if unnamed:
            raise ValueError(f"cfx.checkpoint: names= leaves {unnamed[:3]} of the model's params out of its state "
                             "dict, or not whole; pass the conversion that writes every param (cfx.models.to_hf).")


def _distinct(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` less the repeats of a rectangle (a tied key's)."""
    out, seen = [], set()
    for q in pieces:
        if (q.lo, q.size) not in seen:
            seen.add((q.lo, q.size))
            out.append(q)
    return out


def _pieces(key: str, t: Any, starts: list[int], paths: list[str], shapes: dict) -> list[tuple[str, Piece]]:
    """The ``(cfx path, Piece)`` pairs torch tensor ``key`` (of probe numbers) is made of: a few
    passes over it when it holds one leaf (the usual case), a mask per leaf when it holds several."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float64:
        raise ValueError(f"cfx.checkpoint: names= returned {key!r} as {getattr(t, 'dtype', type(t).__name__)} for "
                         "float64 params; the conversion must keep the params' dtype (cfx.models.to_hf does).")
    t = t.detach()
    if not t.numel():
        return []
    total = starts[-1] + math.prod(shapes[paths[-1]]) if paths else 1
    bounds = torch.tensor(starts, dtype=torch.float64)
    low, high = torch.aminmax(t)
    if low >= 1 and high < total:  # every element is a param's
        first, last = (int(torch.searchsorted(bounds, v, right=True)) - 1 for v in (low, high))
        if first == last:
            return [(paths[first], _piece(key, t, None, starts[first], shapes[paths[first]], paths[first],
                                          bounds=(int(low), int(high))))]
    ids = t.reshape(-1)
    hit = (ids >= 1) & (ids < total) & (ids == ids.round())
    leaves = torch.unique(torch.searchsorted(bounds, ids[hit], right=True) - 1).tolist()
    return [(paths[i], _piece(key, t, (t >= starts[i]) & (t < starts[i] + math.prod(shapes[paths[i]])), starts[i],
                              shapes[paths[i]], paths[i])) for i in leaves]


def _piece(key: str, t: torch.Tensor, inside: torch.Tensor | None, start: int, shape: tuple[int, ...],
           path: str, *, bounds: tuple[int, int] | None = None) -> Piece:
    """The Piece of cfx leaf ``path`` (numbered from ``start``; at ``inside`` of ``t``, None: all of it,
    whose least and greatest numbers are ``bounds``) in torch tensor ``key``: its first and last
    elements give the rectangle, the first one's torch neighbours the dims, then every element is
    checked; ValueError unless that is a rectangle with permuted dims."""
    own = t if inside is None else torch.where(inside, t, torch.inf)
    low, high = bounds or (int(own.min()), int(torch.where(inside, t, -torch.inf).max()))
    lo = _unravel(low - start, shape)
    size = tuple(h + 1 - a for h, a in zip(_unravel(high - start, shape), lo))
    t_lo = _unravel(int(own.argmin()), tuple(t.shape))
    strides = {math.prod(shape[j + 1:]): j for j in range(len(shape)) if size[j] > 1}
    dims = [-1] * len(shape)
    for d in range(t.dim()):
        if t_lo[d] + 1 < t.shape[d]:
            j = strides.get(int(t[t_lo[:d] + (t_lo[d] + 1,) + t_lo[d + 1:]]) - low)
            if j is not None and dims[j] < 0:
                dims[j] = d
    piece = Piece(key, lo, size, t_lo, tuple(dims))
    if all(d >= 0 or n == 1 for d, n in zip(dims, size)):
        count = t.numel() if inside is None else int(inside.sum())
        want = (torch.arange(math.prod(shape), dtype=torch.float64) + start).reshape(shape)[_slices(lo, size)]
        t_box = piece.box(lo, tuple(a + b for a, b in zip(lo, size)))
        if count == math.prod(size) and torch.equal(t[_slices(*t_box)], _to_torch(piece, want, t_box[1])):
            return piece
    raise _not_a_rectangle(path, key)


def _to_torch(piece: Piece, x: torch.Tensor, t_size: tuple[int, ...]) -> torch.Tensor:
    """A cfx rectangle ``x`` laid out as ``piece``'s torch box of shape ``t_size`` (``to_cfx``'s inverse)."""
    mapped = [(d, j) for j, d in enumerate(piece.dims) if d >= 0]
    x = x.reshape([x.shape[j] for _, j in mapped])  # the cfx dims of size 1 dropped
    order = sorted(range(len(mapped)), key=lambda i: mapped[i][0])
    return x.permute(order).reshape(t_size)


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        i, r = divmod(i, n)
        out.append(r)
    return tuple(reversed(out))


def _slices(lo: tuple[int, ...], size: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(lo, size))


def _not_a_rectangle(path: str, key: str) -> ValueError:
    return ValueError(f"cfx.checkpoint: names= puts params leaf {path!r} into {key!r} in a way that is not a "
                      "rectangle with its dimensions permuted; DCP interop reads only such layouts.")
