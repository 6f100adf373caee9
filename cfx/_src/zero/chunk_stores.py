"""Where a ``GeminiEngine``'s chunks live: params, fp32 masters, optimizer state and gradients,
each kind in the tier store of its ``Offload`` home (``gemini.store``: device, host, NVMe), keyed
by kind and chunk, with the bytes moved between tiers counted (``traffic``, by ``"src->dst"``)."""
from __future__ import annotations

import collections
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.gemini.store import make_stores
from cfx._src.mesh import memory
from cfx._src.zero.offload import Offload


class ChunkStores:
    """One engine's tier stores (``stores``: ``{"device": ..., "host": ..., "nvme": ...}``)."""

    def __init__(self, offload: Offload, *, nvme_dir: str | None):
        self.cfg = offload
        self.stores = make_stores(nvme_dir=nvme_dir)
        self.traffic: collections.Counter = collections.Counter()  # bytes by "src->dst"
        self._inner_defs: dict[int, Any] = {}  # per chunk: its optimizer state's structure

    def put(self, tier: str, key: tuple, x: torch.Tensor, kind: str) -> None:
        self.stores[tier].put(key, x, kind=kind)

    def get(self, tier: str, key: tuple) -> torch.Tensor:
        x = self.stores[tier].get(key)
        if tier == "nvme":
            self.traffic["nvme->host"] += x.numel() * x.element_size()
        return x

    def write(self, tier: str, key: tuple, x: torch.Tensor, kind: str) -> None:
        """``x`` as the new value of ``key``: copied into the tensor there (a file: written anew)."""
        if tier == "nvme":
            self.traffic["host->nvme"] += x.numel() * x.element_size()
            self.put(tier, key, x, kind)
        else:
            self.stores[tier].get(key).copy_(x)

    # -- optimizer state: one stored tensor per leaf --------------------------------------------
    def put_inner(self, c: int, inner: Any) -> None:
        leaves, self._inner_defs[c] = tree_util.flatten(inner)
        for j, x in enumerate(leaves):
            self.put(self.cfg.optim_home, ("optim", c, j), x, "optim")

    def load_inner(self, c: int) -> Any:
        td = self._inner_defs[c]
        return tree_util.unflatten(td, [self.get(self.cfg.optim_home, ("optim", c, j))
                                        for j in range(td.num_leaves)])

    def write_inner(self, c: int, inner: Any) -> None:
        for j, x in enumerate(tree_util.leaves(inner)):
            self.write(self.cfg.optim_home, ("optim", c, j), x, "optim")

    # -- gradients ---------------------------------------------------------------------------------
    def grad_chunk(self, c: int, arriving: torch.Tensor, size: int) -> torch.Tensor:
        """Chunk ``c``'s gradient in its home (zeros of ``size`` elements at first), into which
        ``arriving`` is about to be added (its bytes counted as moved there)."""
        home, key = self.cfg.grad_home, ("grad", c)
        if home == "host":
            self.traffic["device->host"] += arriving.numel() * arriving.element_size()
        if key not in self.stores[home]:
            with memory.ops_unwatched():  # booked by the store as "grad", not as an op output
                zeros = torch.zeros(size, dtype=arriving.dtype)
            self.put(home, key, zeros, "grad")
            del zeros
        return self.stores[home].get(key)

    def take_grad(self, c: int, size: int) -> torch.Tensor:
        """Chunk ``c``'s gradient in fp32 (zeros where none arrived), dropped from its store."""
        key, store = ("grad", c), self.stores[self.cfg.grad_home]
        if key not in store:
            return torch.zeros(size, dtype=torch.float32)
        g = store.get(key).to(torch.float32)
        store.delete(key)
        return g
