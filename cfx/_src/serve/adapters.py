"""Several LoRA adapters served side by side in one batch (S-LoRA's and Punica's batching).

``Adapters(params)`` holds named adapters over one base (``add(name, adapters, config)``: what
``cfx.lora.init`` or ``cfx.lora.load_peft`` gives). For every Linear weight any of them adapts it
stacks each adapter's ``A`` ``(in, r)`` and ``B`` ``(r, out)`` and its scale -- index 0 is "no
adapter", zeros; ranks smaller than the largest are padded with zeros, which add nothing -- so a
step's params (``params_for(rows)``, each row's adapter index) carry there a ``LoraWeight`` whose
``A`` ``(B, in, r)``, ``B`` ``(B, r, out)`` and scale ``(B, 1, 1)`` are each row's, and the Linear's
adapter term ``scale * (x A) B`` is a batched product over the rows: one pass of the base model
for every adapter in the batch, none of them merged.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lora.adapters import rewrite
from cfx._src.lora.config import LoraConfig
from cfx._src.nn.lora_weight import LoraWeight, is_weight_node

WHERE = "cfx.serve.Engine.add_adapter"


class Adapters:
    """Named adapters over ``params`` and their stacks (module doc)."""

    def __init__(self, params: Any):
        self.params = params
        self.names: list[str | None] = [None]       # index 0: no adapter
        self.found: dict[str, list[tuple]] = {}     # weight path -> (index, A, B, scale) of each adapter there
        self.stacks: dict[str, tuple] = {}          # weight path -> (A (K, in, r), B (K, r, out), scale (K,))

    def add(self, name: str, adapters: Any, config: LoraConfig) -> None:
        if not isinstance(name, str) or not name or name in self.names:
            raise ValueError(f"{WHERE}: adapter names are distinct, non-empty strings; {name!r} is not.")
        index = len(self.names)
        seen: list[tuple] = []

        def visit(path: str, w: Any, A: torch.Tensor, B: torch.Tensor, i: int) -> Any:
            seen.append((path, A.detach(), B.detach()))
            return w
        rewrite(WHERE, self.params, adapters, config, visit)  # checks the adapters against the params
        self.names.append(name)
        for path, A, B in seen:
            self.found.setdefault(path, []).append((index, A, B, config.scale))
        self._stack()

    def _stack(self) -> None:
        K = len(self.names)
        for path, entries in self.found.items():
            r = max(A.shape[1] for _, A, _, _ in entries)
            _, A0, B0, _ = entries[0]
            A = A0.new_zeros((K, A0.shape[0], r))
            B = B0.new_zeros((K, r, B0.shape[1]))
            scale = torch.zeros(K, dtype=A0.dtype)
            for k, a, b, s in entries:
                A[k, :, :a.shape[1]] = a
                B[k, :b.shape[0]] = b
                scale[k] = s
            self.stacks[path] = (A, B, scale)

    def index(self, name: str | None) -> int:
        if name not in self.names:
            raise ValueError(f"cfx.serve.Engine: no adapter named {name!r}; the engine has "
                             f"{[n for n in self.names if n]} (Engine.add_adapter).")
        return self.names.index(name)

    @staticmethod
    def root(name: str | None) -> bytes | None:
        """What a sequence's prefix-cache keys start from: keys and values computed under an adapter are
        that adapter's, so its blocks are found only by requests naming it."""
        return None if name is None else hashlib.blake2b(b"lora:" + name.encode(), digest_size=16).digest()

    def params_for(self, rows: torch.Tensor) -> Any:
        """The params of a step whose row ``b`` runs adapter ``rows[b]`` (0: none) (module doc)."""
        if not self.stacks or not bool((rows > 0).any()):
            return self.params

        def at(path: str, w: Any) -> Any:
            if path not in self.stacks:
                return w
            A, B, scale = self.stacks[path]
            dev = w.q.device if hasattr(w, "q") else w.device
            idx = rows.to(A.device)
            return LoraWeight(w, A[idx].to(dev), B[idx].to(dev), scale[idx].view(-1, 1, 1).to(dev))
        return tree_util.map_with_path(at, self.params, is_leaf=is_weight_node)
