"""The model state's traffic in a step the estimate times (``estimate._Step`` passes itself as ``step``):
ZeRO-3's gathers and reduce-scatter over ``data`` (``zero3_s``) and offload's copies over the host link and
the node's disks (``offload_s``)."""
from __future__ import annotations

from typing import Any


def zero3_s(step: Any, whole: float) -> float:
    """ZeRO-3's seconds over ``data``: the params gathered in forward and again in backward, the gradients
    reduce-scattered, ``whole`` bytes of each (a data rank's fp32 state); cfx's moves its pieces in the compute
    dtype -- with ``fp8_comm=all_gather`` the blocks' Linear weights but the first block's as e4m3, with
    ``reduce_scatter`` the gradients as e5m2 in an all-to-all (a peer's stack: its own dtype, ``whole``)."""
    gathered, comm = whole, step.plan.fp8_comm.split("+")
    if step.stack["grad_reduce_bytes"] is None:
        gathered = whole = whole * step.bytes / 4
        if "all_gather" in comm:
            sh = step.shape
            gathered -= whole * (sh.layers - 1) * sh.layer_params() / sh.params() * (step.bytes - 1) / step.bytes
    grads = step.collective("data", "reduce_scatter", whole)
    if step.stack["grad_reduce_bytes"] is None and "reduce_scatter" in comm:
        grads = step.collective("data", "all_to_all", whole / step.bytes)  # e5m2 casts, one byte each
    return 2 * step.collective("data", "all_gather", gathered) + grads


def offload_s(step: Any, state: Any) -> float:
    """Offload's traffic per step: params to the GPU and gradients back over the host link; with
    ``nvme`` the optimizer's state read and written from the node's disks too."""
    if step.plan.home == "device":
        return 0.0
    params = step.state_bytes(state, "params")
    pcie = 2 * params / step.cluster.host.busbw * (2 if step.plan.zero == 3 else 1)
    if step.plan.home != "nvme":
        return pcie
    per_gpu = step.cluster.nvme_bw / min(step.cluster.gpus, step.cluster.gpus_per_node)
    return pcie + 2 * (step.state_bytes(state, "optimizer") + 2 * params) / per_gpu
