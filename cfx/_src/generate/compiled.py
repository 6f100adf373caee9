"""``cfx.generate(..., compile=True)``: decoding with shapes that never change, compiled once.

Eager decoding runs a Python call per op per token; on a GPU a small model's step is then launch
overhead. Here the step has static shapes -- a ``KVCache(static=True)`` whose every read is the
whole buffer with a mask of the slots written so far, the positions and the next slot as device
tensors -- so ``torch.compile`` builds one graph for it and replays it for every token (on CUDA
with ``mode="reduce-overhead"``: a CUDA graph over the cache and params, whose addresses are marked
static). The prompts are left-padded to a length bucket (a power of two, at least 16: the
padding is masked and positions count real tokens, as for left-padded prompts in eager mode)
and the cache's length is rounded up to a multiple of 32, so calls with nearby lengths share the
prefill graph and the step graph. Tokens are picked outside the graphs, on the device
(``pick.Sampling``), and the loop is ``decode.decode_steps``.

``compile=True`` uses inductor; a string names another ``torch.compile`` backend (``"aot_eager"``
checks the path without code generation). ``compiled_graphs(model)`` counts the graphs built for
a model so far: after a warm-up call, more calls of the same shapes must not raise it.
"""
from __future__ import annotations

import threading
import types
import weakref
from typing import Any, Callable

import torch

from cfx._src.core import context
from cfx._src.core import tree as tree_util
from cfx._src.mesh import context as ctx_lib
from cfx._src.nn.kv_cache import KVCache

BUCKET_MIN, CACHE_ROUND = 16, 32


class CompiledDecode:
    """One model's compiled prefill and step (module doc); ``graphs`` counts what they built.
    Inside ``shard_map`` each rank has its own (its index along an axis is a constant of its graphs)."""

    def __init__(self, model: Any, backend: str, where: tuple | None):
        self.model, self.backend, self.where, self.graphs = model, backend, where, 0
        self._prefill = self._step = None

    def _compiled(self, fn: Callable, name: str, *, replay: bool) -> Callable:
        # a code object of its own: dynamo keeps its graphs per code object, and another rank's
        # graphs (or another model's) would pass this one's guards
        code = fn.__code__.replace(co_name=f"decode_{name}_{id(self):x}")
        own = types.FunctionType(code, fn.__globals__, code.co_name, None, fn.__closure__)
        context.mark_constants()
        return torch.compile(own, backend=self._backend(replay), dynamic=False)

    def _backend(self, replay: bool) -> Callable:
        """``self.backend``, counting the graphs it compiles; inductor's with CUDA graphs (what
        ``mode="reduce-overhead"`` sets) for the step on CUDA."""
        import torch._dynamo

        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            patches = {"triton.cudagraphs": True} if replay and torch.cuda.is_available() else {}
            inner = lambda gm, inputs: compile_fx(gm, inputs, config_patches=patches)  # noqa: E731
        else:
            inner = torch._dynamo.lookup_backend(self.backend)

        def counted(gm: torch.fx.GraphModule, inputs: list) -> Callable:
            self.graphs += 1
            return inner(gm, inputs)
        return counted

    def prefill(self, params: Any, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """The last position's logits ``(B, V)`` after the bucketed prompts ``(B, Tb)``."""
        if self._prefill is None:
            model = self.model
            self._prefill = self._compiled(
                lambda p, x, m, pos, c: model.apply(p, x, mask=m, positions=pos, cache=c)[:, -1], "prefill",
                replay=False)
        return self._prefill(params, tokens, mask, positions, cache)

    def step(self, params: Any, tok: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next logits ``(B, V)`` after one token per row ``(B, 1)`` at ``positions`` ``(B, 1)``."""
        if self._step is None:
            model = self.model
            self._step = self._compiled(
                lambda p, x, pos, c: model.apply(p, x, positions=pos, cache=c)[:, -1], "step", replay=True)
        return self._step(params, tok, positions, cache)


_DECODERS: "weakref.WeakKeyDictionary[Any, dict[tuple, CompiledDecode]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # the rank threads of a local mesh ask at once


def decoder(model: Any, backend: str) -> CompiledDecode:
    """The model's ``CompiledDecode`` for ``backend`` (and this rank, inside ``shard_map``), made
    once and kept while the model lives."""
    where = ctx_lib.compile_key()
    with _LOCK:
        per_model = _DECODERS.setdefault(model, {})
        if (backend, where) not in per_model:
            per_model[backend, where] = CompiledDecode(model, backend, where)
        return per_model[backend, where]


def compiled_graphs(model: Any) -> int:
    """Graphs ``torch.compile`` built for ``model``'s compiled decoding so far, over every backend
    (one per prefill bucket and one for the step, once warm)."""
    return sum(d.graphs for d in _DECODERS.get(model, {}).values())


def bucket(n: int) -> int:
    """The prompt length bucket: the next power of two, at least ``BUCKET_MIN``."""
    return max(BUCKET_MIN, 1 << (n - 1).bit_length())


def start(model: Any, params: Any, prompt: torch.Tensor, mask: torch.Tensor | None, max_new_tokens: int,
          backend: str) -> tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Prefill the bucketed prompts into a static cache; return the first logits ``(B, V)`` and the
    ``advance(tokens, i)`` that feeds each new token through the compiled step."""
    dec = decoder(model, backend)
    if hasattr(model, "check_call"):  # eagerly, once: the graphs check nothing
        model.check_call("cfx.generate", params, prompt, mask)
    B, T = prompt.shape
    Tb = bucket(T)
    mask = torch.ones(B, T, dtype=torch.bool, device=prompt.device) if mask is None else mask.to(torch.bool)
    tokens = torch.nn.functional.pad(prompt, (Tb - T, 0))  # (B, Tb), left-padded
    mask = torch.nn.functional.pad(mask, (Tb - T, 0))
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, Tb): real tokens count from 0
    size = -(-(Tb + max_new_tokens) // CACHE_ROUND) * CACHE_ROUND
    cache = KVCache(B, size, len(model.blocks), device=prompt.device, static=True)
    logits = dec.prefill(params, tokens, mask, positions, cache)
    cache.validated = True
    if torch.cuda.is_available() and prompt.is_cuda:  # CUDA graphs replay over these addresses
        cache.mark_static()
        for leaf in _tensor_leaves(params):
            torch._dynamo.mark_static_address(leaf)
    first = mask.long().sum(1, keepdim=True)  # (B, 1): the first new token's position

    def advance(tok: torch.Tensor, i: int) -> torch.Tensor:
        return dec.step(params, tok[:, None], first + i, cache)
    return logits, advance


def _tensor_leaves(params: Any) -> list[torch.Tensor]:
    return [x for x in tree_util.leaves(params) if isinstance(x, torch.Tensor)]
