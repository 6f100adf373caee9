"""Collectives by mesh axis name, for use inside ``cfx.shard_map``; all differentiable."""
from cfx._src.lax.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
    ragged_all_to_all,
    varying_axes,
)

__all__ = ["all_gather", "all_to_all", "axis_index", "axis_size", "pmax", "pmean", "pmin",
           "ppermute", "psum", "psum_scatter", "pvary", "ragged_all_to_all", "varying_axes"]
