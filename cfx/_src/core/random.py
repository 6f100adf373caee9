"""Explicit, splittable random keys (counter-based, Threefry-2x32) and samplers.

A key is a CPU ``torch.int64`` tensor of shape ``(2,)`` holding two 32-bit words. ``split`` and
``fold_in`` hash keys with Threefry-2x32 (Salmon et al., 2011) in exact integer arithmetic, so a
key derives the same children everywhere. A sampler turns its key into a 64-bit seed for a fresh
CPU ``torch.Generator``, draws there and moves the result to ``device``: the same key gives the
same numbers on every thread, process and device, and no global RNG state is read or changed.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

_MASK = 0xFFFFFFFF
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA
_FOLD_TAG = 0x9E3779B9  # keeps fold_in(key, i) apart from split(key, n)[j]
_SEED_TAG = 0x7F4A7C15  # keeps sampler seeds apart from derived keys

Key = torch.Tensor
Shape = Sequence[int] | int


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def threefry2x32(key: Key, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Threefry-2x32 block cipher (20 rounds) of the counter pair ``(x0, x1)`` under ``key``."""
    k0, k1 = key[..., 0] & _MASK, key[..., 1] & _MASK
    ks = (k0, k1, (k0 ^ k1 ^ _PARITY) & _MASK)
    x0 = (x0 + ks[0]) & _MASK
    x1 = (x1 + ks[1]) & _MASK
    for group in range(5):
        for r in _ROTATIONS[4 * (group % 2): 4 * (group % 2) + 4]:
            x0 = (x0 + x1) & _MASK
            x1 = _rotl(x1, r) ^ x0
        i = group + 1
        x0 = (x0 + ks[i % 3]) & _MASK
        x1 = (x1 + ks[(i + 1) % 3] + i) & _MASK
    return x0, x1


def _check_key(key: Key, where: str) -> None:
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.shape[-1:] != (2,):
        got = f"{type(key).__name__}" if not isinstance(key, torch.Tensor) else f"tensor {key.dtype} {tuple(key.shape)}"
        raise ValueError(f"cfx.random.{where}: expected a key made by cfx.random.key(seed) "
                         f"(int64 tensor of shape (2,)), got {got}.")


def key(seed: int) -> Key:
    """A key from an integer seed (any Python int; taken modulo 2**64)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"cfx.random.key: seed must be an int, got {type(seed).__name__}.")
    seed %= 1 << 64
    return torch.tensor([seed >> 32, seed & _MASK], dtype=torch.int64, device="cpu")  # (whatever the default device)


def split(key: Key, num: int = 2) -> Key:
    """``num`` new independent keys, stacked as a ``(num, 2)`` tensor (iterate or index it)."""
    _check_key(key, "split")
    if key.dim() != 1:
        raise ValueError(f"cfx.random.split: expected a single key of shape (2,), got {tuple(key.shape)}.")
    if is_fake(key):  # a shape-only trace (eval_shape of an init): keys without values, and no cipher to run
        return torch.empty((num, 2), dtype=torch.int64)
    counters = torch.arange(2 * num, dtype=torch.int64, device=key.device)
    y0, y1 = threefry2x32(key, counters[:num], counters[num:])
    return torch.stack([y0, y1], dim=-1)


def fold_in(key: Key, data: int) -> Key:
    """A new key derived from ``key`` and the integer ``data`` (a step or rank number)."""
    _check_key(key, "fold_in")
    if is_fake(key):  # as in split
        return torch.empty(tuple(key.shape), dtype=torch.int64)
    data = int(data) % (1 << 64)
    x0 = torch.tensor((data >> 32) ^ _FOLD_TAG, dtype=torch.int64, device=key.device)
    x1 = torch.tensor(data & _MASK, dtype=torch.int64, device=key.device)
    y0, y1 = threefry2x32(key, x0, x1)
    return torch.stack([y0, y1], dim=-1)


def _generator(key: Key) -> torch.Generator:
    _check_key(key, "sampler")
    if key.dim() != 1:
        raise ValueError(f"cfx.random: samplers take a single key of shape (2,), got {tuple(key.shape)}; "
                         "index the result of split first.")
    g = torch.Generator(device="cpu")
    if is_fake(key):  # a shape-only trace (the remat profiler's): no values exist or are read
        return g
    y0, y1 = threefry2x32(key, torch.tensor(_SEED_TAG, device=key.device), torch.tensor(0, device=key.device))
    g.manual_seed((int(y0) << 32) | int(y1))
    return g


def _device(device) -> torch.device:
    """Where a sample goes: ``device``, else torch's default (``with torch.device("cuda"):``). Every
    sample is drawn on the CPU from the key's CPU generator first: the same values on every device."""
    return torch.device(device) if device is not None else torch.get_default_device()


def _shape(shape: Shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def normal(key: Key, shape: Shape = (), dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Standard normal samples."""
    if is_fake(key):  # a shape-only trace (eval_shape of an init): nothing to draw
        return torch.empty(_shape(shape), dtype=dtype, device=_device(device))
    x = torch.randn(_shape(shape), generator=_generator(key), dtype=_draw_dtype(dtype), device="cpu")
    return x.to(device=_device(device), dtype=dtype)


def uniform(key: Key, shape: Shape = (), dtype: torch.dtype = torch.float32, minval: float = 0.0,
            maxval: float = 1.0, device=None) -> torch.Tensor:
    """Uniform samples in ``[minval, maxval)``."""
    x = torch.rand(_shape(shape), generator=_generator(key), dtype=_draw_dtype(dtype), device="cpu")
    x = x * (maxval - minval) + minval
    return x.to(device=_device(device), dtype=dtype)


def bernoulli(key: Key, p: float | torch.Tensor = 0.5, shape: Shape | None = None, device=None) -> torch.Tensor:
    """Boolean samples that are True with probability ``p`` (broadcast against ``shape``)."""
    p_t = torch.as_tensor(p, dtype=torch.float64, device="cpu")
    if shape is None:
        shape = tuple(p_t.shape)
    u = torch.rand(_shape(shape), generator=_generator(key), dtype=torch.float64, device="cpu")
    return (u < p_t).to(device=_device(device))


def randint(key: Key, shape: Shape, minval: int, maxval: int, dtype: torch.dtype = torch.int64,
            device=None) -> torch.Tensor:
    """Integers uniform in ``[minval, maxval)``."""
    if maxval <= minval:
        raise ValueError(f"cfx.random.randint: need minval < maxval, got [{minval}, {maxval}).")
    x = torch.randint(minval, maxval, _shape(shape), generator=_generator(key), dtype=torch.int64, device="cpu")
    return x.to(device=_device(device), dtype=dtype)


def truncated_normal(key: Key, lower: float = -2.0, upper: float = 2.0, shape: Shape = (),
                     dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Standard normal samples conditioned on ``lower < x < upper`` (inverse-CDF method)."""
    if not lower < upper:
        raise ValueError(f"cfx.random.truncated_normal: need lower < upper, got ({lower}, {upper}).")
    u = torch.rand(_shape(shape), generator=_generator(key), dtype=torch.float64, device="cpu")
    lo = torch.special.ndtr(torch.tensor(lower, dtype=torch.float64, device="cpu"))
    hi = torch.special.ndtr(torch.tensor(upper, dtype=torch.float64, device="cpu"))
    x = torch.special.ndtri(lo + u * (hi - lo))
    eps = math.ulp(1.0) * 4
    x = x.clamp(lower + eps * abs(lower), upper - eps * abs(upper))
    return x.to(device=_device(device), dtype=dtype)


def gumbel(key: Key, shape: Shape = (), dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Standard Gumbel samples ``-log(-log(u))``."""
    u = torch.rand(_shape(shape), generator=_generator(key), dtype=torch.float64, device="cpu")
    u = u.clamp(min=torch.finfo(torch.float64).tiny)
    return (-torch.log(-torch.log(u))).to(device=_device(device), dtype=dtype)


def categorical(key: Key, logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices drawn from ``softmax(logits)`` along ``dim`` (Gumbel-max), one per other position."""
    g = gumbel(key, logits.shape, dtype=torch.float64, device=logits.device)
    return torch.argmax(logits.double() + g, dim=dim)


def permutation(key: Key, n: int, device=None) -> torch.Tensor:
    """A random permutation of ``range(n)``."""
    return torch.randperm(n, generator=_generator(key), device="cpu").to(device=_device(device))
