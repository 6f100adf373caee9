"""cfx: Colossal-AI's ideas as composable JAX-style transforms on PyTorch.

Models are pure functions over parameter pytrees; parallelism and memory strategies are
function transformations over named device meshes.
"""
from cfx import amp, checkpoint, models, nn, optim, random, tree
from cfx._src.transforms import grad, jvp, value_and_grad, vmap

__version__ = "0.1.0"

__all__ = ["amp", "checkpoint", "grad", "jvp", "models", "nn", "optim", "random", "tree",
           "value_and_grad", "vmap"]
