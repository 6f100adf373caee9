"""The cost model the search prices plans with: seconds of compute and of collectives per rank.

Compute is an op's FLOPs over its split and one rank's throughput, plus, for an op that is not a
view, its output's bytes on the rank over the memory bandwidth (elementwise ops, norms and
softmaxes take no FLOPs by PyTorch's count but are not free); a collective step (one of
``cfx.reshard``'s moves along one mesh axis, ``Step.nbytes`` sent per rank under ring algorithms)
costs ``latency + nbytes / bandwidth`` of its axis (alpha-beta). Axes not named in a per-axis dict
take the ``"*"`` entry. ``calibrate(mesh)`` measures these on a mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class CostModel:
    flops_per_s: float = 1e11                        # one rank's matmul throughput
    bandwidth: float | Mapping[str, float] = 1e10    # bytes per second per rank, per mesh axis
    latency: float | Mapping[str, float] = 1e-5      # seconds per collective step, per mesh axis
    memory_bandwidth: float = 1e10                   # output bytes per second of a memory-bound op
    measured: bool = False                           # calibrate()'s: its seconds are this machine's

    def compute(self, flops: float, div: int = 1) -> float:
        return flops / (div * self.flops_per_s)

    def memory(self, nbytes: float) -> float:
        """Seconds of a memory-bound op writing ``nbytes`` on a rank (and reading about as much)."""
        return nbytes / self.memory_bandwidth

    def step(self, axis: str, nbytes: float) -> float:
        """Seconds of one collective step sending ``nbytes`` per rank along ``axis``."""
        return _of(self.latency, axis) + nbytes / _of(self.bandwidth, axis)


def _of(value: float | Mapping[str, float], axis: str) -> float:
    if isinstance(value, Mapping):
        return value[axis] if axis in value else value["*"]
    return value
