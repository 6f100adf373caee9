"""Equal-size chunks of gathered-layer shards: the unit of placement of ``GeminiEngine``.

Each gathered layer's params form a *group*; this rank's shard of a group (``flat.GroupLayout``,
S elements) is all-gathered by that layer alone. The engine packs the group shards, in execution
order (the order of the groups, which the warm-up accesses follow), into flat chunks of one size:
a group that does not fit in what is left of the current chunk starts the next one, so a group
never splits across chunks and the gather of a layer reads one slice of one chunk. The size is
``cfx.gemini.search_chunk_size`` over the group shard sizes (exact: every size from the largest
group shard to ``max_size``, default twice that), the one with the least padding (*waste*), ties
to the smaller. Params, gradients, master weights and optimizer state all follow this chunking:
one flat buffer per chunk and tier, moved, fetched, evicted and stepped as a whole.
"""
from __future__ import annotations

import dataclasses

import torch

from cfx._src.gemini.packing import ChunkLayout, ChunkSearch, search_chunk_size
from cfx._src.core.text import format_bytes


@dataclasses.dataclass(frozen=True)
class Chunking:
    search: ChunkSearch                  # size, n_chunks, waste (padding elements), waste_fraction
    numels: tuple[int, ...]              # per group: its shard's elements
    chunk_of: tuple[int, ...]            # per group: its chunk
    offset: tuple[int, ...]              # per group: where its shard starts in its chunk
    groups: tuple[tuple[int, ...], ...]  # per chunk: its groups, in execution order

    @property
    def size(self) -> int:
        return self.search.size

    @property
    def n_chunks(self) -> int:
        return len(self.groups)

    def view(self, chunk: torch.Tensor, g: int) -> torch.Tensor:
        """Group ``g``'s shard inside its chunk's flat buffer (a view)."""
        return chunk[self.offset[g]:self.offset[g] + self.numels[g]]

    def pack(self, shards: list[torch.Tensor], k: int) -> torch.Tensor:
        """Chunk ``k``'s flat buffer from the groups' shards (zeros in the padding)."""
        out = torch.zeros(self.size, dtype=shards[self.groups[k][0]].dtype)
        for g in self.groups[k]:
            self.view(out, g).copy_(shards[g])
        return out


def pack_groups(numels: list[int], *, max_size: int | None = None) -> Chunking:
    """The chunking of group shards of ``numels`` elements, given in execution order."""
    numels = [int(n) for n in numels]
    search = search_chunk_size(numels, max_size=max_size or 2 * max(max(numels), 1), exact=True)
    layout = ChunkLayout.build([(str(g), n) for g, n in enumerate(numels)], search.size)
    places = [layout.places[str(g)] for g in range(len(numels))]
    groups = tuple(tuple(g for g, p in enumerate(places) if p.chunk == k) for k in range(layout.n_chunks))
    assert layout.n_chunks == search.n_chunks and layout.waste == search.waste
    return Chunking(search, tuple(numels), tuple(p.chunk for p in places), tuple(p.offset for p in places),
                    groups)


def check_budget(chunking: Chunking, itemsize: int, n: int, budget: int, first_paths: list[str], *,
                 where: str = "GeminiEngine: auto placement", knob: str = "device_budget_bytes",
                 other_fixes: str = "give the engine a smaller max_chunk_size, split the layer, or use "
                                    "cfx.gemini.host()") -> None:
    """ValueError unless ``budget`` bytes hold every chunk with its largest gathered payload;
    the message starts with ``where``, names ``knob`` as what to raise and ``other_fixes``."""
    chunk_bytes = chunking.size * itemsize
    need = [chunk_bytes + max(chunking.numels[g] for g in gs) * itemsize * n for gs in chunking.groups]
    k = max(range(len(need)), key=need.__getitem__)
    if need[k] > budget:
        raise ValueError(
            f"{where} needs at least {need[k]} bytes of device memory for chunk {k} "
            f"(groups {list(chunking.groups[k])}: {first_paths[k]!r}...): the chunk of {chunk_bytes} B "
            f"({chunking.size} elements) plus its largest gathered payload of {need[k] - chunk_bytes} B, "
            f"before any activation, but the budget is {budget} bytes ({format_bytes(budget)}). Raise {knob} to "
            f"well above {need[k]} ({format_bytes(need[k])}), or {other_fixes}.")
