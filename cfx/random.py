"""Explicit splittable keys and samplers: ``key``, ``split``, ``fold_in``, ``normal``, ..."""
from cfx._src.random import (
    Key,
    bernoulli,
    fold_in,
    key,
    normal,
    permutation,
    randint,
    split,
    threefry2x32,
    truncated_normal,
    uniform,
)

__all__ = ["Key", "bernoulli", "fold_in", "key", "normal", "permutation", "randint", "split",
           "threefry2x32", "truncated_normal", "uniform"]
