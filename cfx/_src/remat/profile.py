"""Profile a chain of stages without computing: FLOPs and activation bytes from a fake-tensor trace.

Each stage ``fn(params, x, **kwargs) -> y`` runs once under ``FakeTensorMode`` (tensors carry
shape, dtype and device but no data, so the same kernels are chosen as in a real run on that
device — e.g. the CPU flash attention, which saves a log-sum-exp instead of the s x s scores) and
``FlopCounterMode``; its backward runs the same way. What the forward saves for backward is read
through a saved-tensor hook and deduplicated by storage identity; the stage's input and its
parameters are not counted (they live elsewhere). The result is a :class:`Chain` in bytes and FLOPs:

    x[i]    = bytes of stage i's output (x[0]: the chain input)
    xbar[i] = bytes stage i saves for backward, its output included
    fw[i], bw[i] = forward / backward FLOPs of stage i
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from cfx._src.core import tree as tree_util
from cfx._src.remat.chain import Chain
from cfx._src.remat.saved import SavedTensors, storage_key, storage_keys


def _cpu_flash(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's counter knows the CUDA attention kernels; the CPU flash kernel is counted the same way
_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}


@dataclasses.dataclass(frozen=True)
class StageProfile:
    name: str
    fw_flops: int
    bw_flops: int
    out_bytes: int
    saved_bytes: int       # saved for backward, output included, input and params excluded
    out_shape: tuple
    out_dtype: torch.dtype


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile_stage(fn: Callable, params: Any, x: torch.Tensor, kwargs: dict, *, mode: FakeTensorMode,
                  name: str = "") -> tuple[StageProfile, torch.Tensor]:
    """One stage's costs from a fake-tensor run of its forward and backward; also its fake output.

    ``x`` is a fake tensor of ``mode``; ``params`` real or fake; ``kwargs`` (masks, keys) stay real.
    """
    fake = lambda t: (t if isinstance(t, torch.Tensor) and t.device.type == "meta"  # noqa: E731
                      else mode.from_tensor(t)).detach().requires_grad_(t.is_floating_point())
    f_params = tree_util.map(lambda t: fake(t) if isinstance(t, torch.Tensor) else t, params)
    f_x = x.detach().requires_grad_(x.is_floating_point())
    inputs = [f_x] + [t for t in tree_util.leaves(f_params) if isinstance(t, torch.Tensor)]
    with mode, FlopCounterMode(display=False, custom_mapping=_FLOPS) as counter, torch.enable_grad():
        with SavedTensors(storage_keys(inputs)) as saved:
            out = fn(f_params, f_x, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"remat.solve: {name or 'a stage'} returned {type(out).__name__}; each "
                             "stage of a chain must map one tensor to one tensor.")
        fw = counter.get_total_flops()
        wrt = [t for t in inputs if t.requires_grad]
        if out.requires_grad and wrt:
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
        bw = counter.get_total_flops() - fw
    out_bytes = _nbytes(out)
    saved_bytes = saved.nbytes()
    if storage_key(out) not in saved.storages:
        saved_bytes += out_bytes  # the output is kept as the next stage's input in any case
    prof = StageProfile(name, fw, bw, out_bytes, saved_bytes, tuple(out.shape), out.dtype)
    return prof, out.detach()


def profile_chain(fns: Sequence[Callable], params: Sequence[Any], x: torch.Tensor,
                  kwargs: Sequence[dict], *, names: Sequence[str] | None = None) -> tuple[Chain, list]:
    """Profile every stage in order, each fed the fake output of the one before; no real compute."""
    names = names or [f"stage {i + 1}" for i in range(len(fns))]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    profiles: list[StageProfile] = []
    cache: dict[Any, tuple] = {}
    cur = mode.from_tensor(x)
    for fn, p, kw, name in zip(fns, params, kwargs, names):
        key = _cache_key(fn, p, cur, kw)
        hit = cache.get(key) if key is not None else None
        if hit is None:
            hit = profile_stage(fn, p, cur, kw, mode=mode, name=name)
            if key is not None:
                cache[key] = hit
        prof, out = hit
        profiles.append(dataclasses.replace(prof, name=name))
        cur = out
    chain = Chain.from_stages(fw=[p.fw_flops for p in profiles], bw=[p.bw_flops for p in profiles],
                              x=[_nbytes(x)] + [p.out_bytes for p in profiles],
                              xbar=[p.saved_bytes for p in profiles])
    return chain, profiles


def _cache_key(fn, params, x, kwargs):
    """Identical stages (same layer object, same shapes) have identical costs: profile once."""
    try:
        shapes = tuple((tuple(t.shape), t.dtype) for t in tree_util.leaves(params) if isinstance(t, torch.Tensor))
        kw = tuple(sorted((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
                          for k, v in kwargs.items()))  # a key's value does not change the costs
        key = (getattr(fn, "__self__", fn), getattr(fn, "__func__", None), shapes,
               tuple(x.shape), x.dtype, x.device.type, kw)
        hash(key)
        return key
    except TypeError:
        return None
