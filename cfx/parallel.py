"""Parallelism as layer transforms and rules: ``tensor_parallel`` (Megatron), ``MEGATRON_RULES``,
``tensor_parallel_grid`` (2D / 2.5D / 3D tensor parallelism over a ``TensorGrid``, specs from ``grid_specs``),
``ring_attention`` over a sequence axis (with ``zigzag_indices``), ``dap`` (Dynamic Axial
Parallelism for the Evoformer), and ``Plan``: the whole strategy (pipe x data x model, ZeRO,
remat, schedule) as one object; ``Cluster``, ``estimate`` and ``search``: that plan's step time, MFU and
memory per GPU on a cluster one does not have, and the best plans for one."""
from cfx._src.models.evoformer_dap import DAPEvoformer, dap
from cfx._src.parallel.expert import EXPERT_RULES, expert_grads, expert_parallel, tensor_parallel_experts
from cfx._src.parallel.megatron import MEGATRON_RULES, TensorParallelBlock, tensor_parallel
from cfx._src.parallel.ring import ring_attention, zigzag_indices
from cfx._src.parallel.sequence import SequenceSplit, sequence_grads, sequence_parallel
from cfx._src.parallel.tp_block import GridBlock, grid_specs, tensor_parallel_grid
from cfx._src.parallel.tp_grid import TensorGrid
from cfx._src.parallel.rules import Rules
from cfx._src.plan.plan import Plan
from cfx._src.plan.program import Program
from cfx._src.plan.protocol import TrainProgram, TrainState
from cfx._src.parallel.state import state_specs, tree_pmean, tree_psum
from cfx._src.estimate.cluster import Cluster, Gpu, Link
from cfx._src.estimate.estimate import Estimate, estimate
from cfx._src.estimate.search import Search, search
from cfx._src.estimate.workload import TransformerShape

__all__ = ["Cluster", "Estimate", "Gpu", "Link", "Search", "TransformerShape", "estimate", "search", "DAPEvoformer", "EXPERT_RULES", "GridBlock", "MEGATRON_RULES", "Plan", "Program", "Rules", "TrainProgram", "TrainState", "SequenceSplit", "TensorGrid", "TensorParallelBlock", "dap", "expert_grads", "expert_parallel", "grid_specs", "ring_attention", "sequence_grads", "sequence_parallel",
           "state_specs", "tensor_parallel", "tensor_parallel_experts", "tensor_parallel_grid", "tree_pmean", "tree_psum", "zigzag_indices"]
