"""Remat policies (JAX's ``jax.checkpoint_policies``): which saved tensors stay, move or go."""
from cfx._src.remat.policies import (
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    Saved,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    offload_these_names,
    save_any_names_but_these,
    save_only_these_names,
)

__all__ = ["OFFLOAD", "RECOMPUTE", "SAVE", "Saved", "dots_saveable", "everything_saveable",
           "nothing_saveable", "offload_these_names", "save_any_names_but_these", "save_only_these_names"]
