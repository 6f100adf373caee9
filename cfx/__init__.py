"""cfx: Colossal-AI's ideas as composable JAX-style transforms on PyTorch.

Models are pure functions over parameter pytrees; parallelism and memory strategies are
function transformations over named device meshes.
"""
from cfx import (amp, autoshard, checkpoint, checkpoint_policies, diffusion, gemini, lax, lora, memory, models, nn,
                 optim, parallel, pipeline, quant, random, remat, tree, zero)
from cfx._src.spmd.arrays import device_get, device_put, reshard
from cfx._src.autochunk.api import autochunk
from cfx._src.spmd.init_sharded import init_sharded
from cfx._src.transforms.jit import jit
from cfx._src.lax.stats import CommStats, comm_stats
from cfx._src.mesh.ledger import CollectiveMismatch, CollectiveTimeout
from cfx._src.mesh.mesh import Mesh
from cfx._src.mesh.spec import P
from cfx._src.parallel.rules import Rules
from cfx._src.remat.engine import ActivationStats, activation_stats, checkpoint_name
from cfx._src.spmd.resharding import ReshardPath, reshard_plan
from cfx._src.transforms.shapes import ShapeDtype, eval_shape
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.sharded import ShardedArray
from cfx._src.transforms.autodiff import grad, hessian, jacfwd, jacrev, jvp, value_and_grad, vmap

ReshardPlan = ReshardPath  # its name until 0.2 (one class per name: cfx.parallel.Plan is the strategy)

__version__ = "0.1.0"


def __getattr__(name: str):
    """``cfx.generate`` (a callable module: the function and ``python -m cfx.generate``), ``cfx.serve``
    (the serving engine) and ``cfx.testing`` (hypothesis strategies: a test dependency), imported on
    first use, so that ``python -m cfx.generate`` runs it fresh and ``import cfx`` needs no hypothesis."""
    if name in ("generate", "serve", "testing"):
        import importlib
        return importlib.import_module(f"cfx.{name}")
    raise AttributeError(f"module 'cfx' has no attribute {name!r}")

__all__ = [
    "ActivationStats", "CollectiveMismatch", "CollectiveTimeout", "CommStats", "Mesh", "P", "ReshardPath", "ReshardPlan", "Rules", "ShapeDtype", "ShardedArray", "activation_stats", "amp",
    "autochunk", "autoshard", "checkpoint", "checkpoint_name", "checkpoint_policies", "comm_stats", "device_get", "device_put",
    "diffusion", "eval_shape",
    "gemini", "generate", "grad", "hessian", "init_sharded", "jacfwd", "jacrev", "jit", "jvp", "lax", "lora", "memory", "models", "nn", "optim", "parallel", "pipeline", "quant",
    "random", "remat", "reshard", "reshard_plan", "shard_map", "testing", "tree", "value_and_grad", "vmap", "zero",
]
