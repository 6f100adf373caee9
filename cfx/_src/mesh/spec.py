"""``P``: a partition spec, indexed by tensor dimension (JAX's ``PartitionSpec``)."""
from __future__ import annotations

from typing import Iterator


class P(tuple):
    """``P("data", None)``: dim 0 split over mesh axis ``data``, dim 1 whole.

    An entry is ``None`` (not split), an axis name, or a tuple of axis names (the dimension is
    split over their product, major to minor). Trailing dimensions not named are not split.
    ``P()`` is fully replicated.
    """

    def __new__(cls, *entries):
        norm = []
        for e in entries:
            if isinstance(e, list):
                e = tuple(e)
            if isinstance(e, tuple):
                e = tuple(e) if len(e) != 1 else e[0]
                if e == ():
                    e = None
            norm.append(e)
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes splitting tensor dimension ``dim`` (empty when not split)."""
        if dim >= len(self):
            return ()
        e = self[dim]
        if e is None:
            return ()
        return (e,) if isinstance(e, str) else tuple(e)

    def all_axes(self) -> Iterator[str]:
        for dim in range(len(self)):
            yield from self.axes_of(dim)


def is_spec(x) -> bool:
    return isinstance(x, P)
