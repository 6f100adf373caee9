"""Explicit splittable keys and samplers: ``key``, ``split``, ``fold_in``, ``normal``, ..."""
from cfx._src.core.random import (
    Key,
    bernoulli,
    categorical,
    fold_in,
    gumbel,
    key,
    normal,
    permutation,
    randint,
    split,
    threefry2x32,
    truncated_normal,
    uniform,
)

__all__ = ["Key", "bernoulli", "categorical", "fold_in", "gumbel", "key", "normal", "permutation", "randint", "split",
           "threefry2x32", "truncated_normal", "uniform"]
