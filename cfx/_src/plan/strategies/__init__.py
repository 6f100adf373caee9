"""The strategies a Plan is made of, one module each, listed once in the order they apply
(``cfx._src.plan.strategy`` documents the protocol and its phases).

The order matters where two strategies act in the same phase: the pipeline's schedule replaces how
a rank computes its loss and offload's placement wraps that; the model's parallel forms apply
experts, sequence, Megatron, the grid, then float8's Linears (inside every wrapper); a block is gathered by ZeRO-3 inside remat's
recomputation (data before remat); gradients are reduced over ``expert``, ``seq``, ``model``
(Megatron-SP), then averaged over ``data``.
"""
from __future__ import annotations

from cfx._src.plan.strategies.data import Data
from cfx._src.plan.strategies.expert import Expert
from cfx._src.plan.strategies.float8 import Float8
from cfx._src.plan.strategies.grid import Grid
from cfx._src.plan.strategies.megatron import Megatron
from cfx._src.plan.strategies.offload import Offload
from cfx._src.plan.strategies.pipe import Pipe
from cfx._src.plan.strategies.remat import Remat
from cfx._src.plan.strategies.sequence import Sequence

STRATEGIES = (Pipe(), Expert(), Sequence(), Megatron(), Grid(), Float8(), Data(), Remat(), Offload())
