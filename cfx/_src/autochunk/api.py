"""``cfx.autochunk``: a function's inference run in chunks so its activations fit a memory budget.

::

    chunked = cfx.autochunk(model.apply, (params, m, z), memory_budget="2GiB",
                            kwargs=dict(msa_mask=msa_mask, pair_mask=pair_mask))
    m, z = chunked(params, m, z, msa_mask=msa_mask, pair_mask=pair_mask)
    print(chunked.report())     # the regions, their dims and chunk sizes, the estimated peaks

The function (pure, of pytrees of tensors) is traced once per input signature into an aten
graph on fake tensors (nothing runs); its activation memory is estimated op by op (``estimate``);
regions -- runs of ops that no op reduces along some dim -- are cut into chunks along that dim
until the estimated peak fits (``flow``, ``search``), and the graph runs with those regions as
loops (``rewrite``). The results are the unchunked function's (the same ops on slices; float
sums that a region splits do not exist: a reduction along the chunked dim ends the region).
Inference only: the chunked function runs under ``torch.no_grad()``. ``chunk_size=`` arguments a
model offers for manual chunking stay available and compose (they are traced as they run).

The search is greedy over the graph's ops (seconds for a few Evoformer blocks, growing with the
square of the graph). For a deep stack of identical blocks, chunk one block: its plan depends only
on the shapes, so it serves every block::

    block = cfx.autochunk(lambda p, m, z: model.blocks[0].apply(p, (m, z)), (params["blocks"][0], m, z),
                          memory_budget="2GiB")
    for p in params["blocks"]:
        m, z = block(p, m, z)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from cfx._src.core import tree as tree_util
from cfx._src.autochunk.search import Choice, search
from cfx._src.core.text import format_bytes, parse_bytes


@dataclasses.dataclass
class Compiled:
    """One input signature's chunked graph and what the search found."""

    module: fx.GraphModule
    outputs: Any                 # the output pytree's structure
    choices: list[Choice]
    unchunked_bytes: int         # estimated peak activation bytes without chunks
    chunked_bytes: int           # ... with them


class Chunked:
    """``fn`` with AutoChunk's regions for ``memory_budget`` (module doc); callable like ``fn``."""

    def __init__(self, fn: Callable[..., Any], budget: int, *, window: int = 48, progress: bool = False):
        self.fn, self.budget, self.window, self.progress = fn, budget, window, progress
        self._compiled: dict[Any, Compiled] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self.compile(*args, **kwargs)
        _, tensors = _signature(args, kwargs)
        with torch.no_grad():
            out = compiled.module(*tensors)
        return tree_util.unflatten(compiled.outputs, list(out))

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        """Trace and search for these arguments' signature (cached), without running."""
        key, tensors = _signature(args, kwargs)
        if key not in self._compiled:
            gm, outputs = _trace(self.fn, args, kwargs)
            bar = _bar() if self.progress else None
            gm, choices, before, after = search(gm, self.budget, window=self.window,
                                                progress=None if bar is None else bar.step)
            if bar is not None:
                bar.close()
            self._compiled[key] = Compiled(gm, outputs, choices, before, after)
        return self._compiled[key]

    def report(self, *args: Any, **kwargs: Any) -> str:
        """A table of the regions chosen for these arguments (default: the last signature compiled)."""
        if args or kwargs:
            c = self.compile(*args, **kwargs)
        elif self._compiled:
            c = list(self._compiled.values())[-1]
        else:
            raise ValueError("cfx.autochunk: nothing compiled yet; call it (or .compile) with arguments first.")
        lines = [f"estimated peak activations: {format_bytes(c.unchunked_bytes)} unchunked -> {format_bytes(c.chunked_bytes)} "
                 f"chunked (budget {format_bytes(self.budget)})"]
        lines += [f"  {ch.op:<24} {ch.output:<20} dim {ch.dim} of {ch.length} in {ch.chunks} chunks of {ch.size} "
                  f"({ch.ops} ops) -> peak {format_bytes(ch.peak)}" for ch in c.choices]
        return "\n".join(lines)


def autochunk(fn: Callable[..., Any], example_args: tuple = (), memory_budget: int | str = "1GiB", *,
              kwargs: dict | None = None, window: int = 48, progress: bool = False) -> Chunked:
    """``fn`` chunked so that its estimated peak activation memory fits ``memory_budget`` (bytes
    or ``"512MiB"``), planned now for ``example_args`` / ``kwargs`` (module doc). Other input
    shapes plan again on their first call. A budget no chunking reaches is a ValueError naming the
    estimate and the tensors that keep it high."""
    if not callable(fn):
        raise ValueError(f"cfx.autochunk: expected a function, got {type(fn).__name__}.")
    budget = parse_bytes(memory_budget)
    if budget <= 0:
        raise ValueError(f"cfx.autochunk: memory_budget must be positive, got {memory_budget!r}.")
    out = Chunked(fn, budget, window=window, progress=progress)
    out.compile(*tuple(example_args), **(kwargs or {}))
    return out


def _signature(args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
    leaves, treedef = tree_util.flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    key = (treedef, tuple((tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else ("v", x)
                          for x in leaves))
    try:
        hash(key)
    except TypeError:
        raise ValueError("cfx.autochunk: non-tensor arguments must be hashable (they are baked into the "
                         "traced graph).") from None
    return key, tensors


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[fx.GraphModule, Any]:
    leaves, treedef = tree_util.flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    structure = {}

    def flat(*tensors):
        full = list(leaves)
        for i, t in zip(where, tensors):
            full[i] = t
        a, k = tree_util.unflatten(treedef, full)
        outs, structure["out"] = tree_util.flatten(fn(*a, **k))
        return tuple(outs)
    with torch.no_grad():
        gm = make_fx(flat, tracing_mode="fake")(*(leaves[i] for i in where))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, structure["out"]


class _bar:
    """A progress bar over the search's rounds, showing the estimated peak."""

    def __init__(self):
        from tqdm.auto import tqdm
        self.tqdm = tqdm(desc="autochunk", unit="region")

    def step(self, round_: int, peak: int) -> None:
        self.tqdm.update(1 if round_ else 0)
        self.tqdm.set_postfix(peak=format_bytes(peak), refresh=False)

    def close(self) -> None:
        self.tqdm.close()
