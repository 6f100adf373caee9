"""Parallelism as layer transforms and rules: ``tensor_parallel`` (Megatron), ``MEGATRON_RULES``."""
from cfx._src.parallel.megatron import MEGATRON_RULES, TensorParallelBlock, tensor_parallel
from cfx._src.parallel.rules import Rules
from cfx._src.parallel.state import sharded_global_norm, state_specs, tree_pmean, tree_psum

__all__ = ["MEGATRON_RULES", "Rules", "TensorParallelBlock", "sharded_global_norm", "state_specs", "tensor_parallel",
           "tree_pmean", "tree_psum"]
