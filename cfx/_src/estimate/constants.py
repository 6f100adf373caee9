"""Every constant the cluster estimate uses, each with its source: one file to audit.

Peak figures are the vendors' datasheets (dense, no sparsity). The efficiencies -- what share of a
peak real kernels sustain -- are the estimate's calibration: one set per GPU kind, the same for every
model and plan, set once from the published runs named beside them and never per row
(``cfx.bench estimate`` prints how far every row lands from its paper; docs/ESTIMATE.md).

Units: FLOP/s, bytes, bytes/s (one direction), seconds.
"""
from __future__ import annotations

TB, GB = 1e12, 1e9
TFLOPS = 1e12

# -- GPUs: dense peak FLOP/s per dtype, HBM bytes and bandwidth -------------------------------------
GPUS = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4: FP16/BF16 tensor 312 TF, TF32 156 TF, FP32 19.5 TF;
    # HBM2 40 GB at 1,555 GB/s, HBM2e 80 GB at 2,039 GB/s; NVLink 3 600 GB/s (both directions together).
    "a100-40gb": dict(flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "fp32": 156 * TFLOPS, "fp8": 312 * TFLOPS},
                      vector_flops=19.5 * TFLOPS, memory=40 * GB, memory_bw=1555 * GB, calibration="ampere"),
    "a100-80gb": dict(flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "fp32": 156 * TFLOPS, "fp8": 312 * TFLOPS},
                      vector_flops=19.5 * TFLOPS, memory=80 * GB, memory_bw=2039 * GB, calibration="ampere"),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: FP16/BF16 tensor 989 TF dense (1,979 sparse), FP8
    # 1,979 TF dense, TF32 495 TF, FP32 67 TF; HBM3 80 GB at 3.35 TB/s; NVLink 4 900 GB/s both directions.
    "h100-80gb": dict(flops={"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "fp32": 495 * TFLOPS, "fp8": 1979 * TFLOPS},
                      vector_flops=67 * TFLOPS, memory=80 * GB, memory_bw=3350 * GB, calibration="hopper"),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: the H100's compute, HBM3e 141 GB at 4.8 TB/s.
    "h200": dict(flops={"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "fp32": 495 * TFLOPS, "fp8": 1979 * TFLOPS},
                 vector_flops=67 * TFLOPS, memory=141 * GB, memory_bw=4800 * GB, calibration="hopper"),
}

# -- what kernels sustain, per GPU generation ------------------------------------------------------
# matmul: the share of the tensor-core peak a large GEMM sustains, and the FLOPs of one GEMM at which
#   it reaches half of that (small GEMMs do not fill the GPU's SMs: wave quantisation, launch);
# attention: the attention core's matmuls (QK^T, PV) fused (flash), and unfused (batched GEMMs over a
#   head dimension of 64-128: low arithmetic intensity);
# memory: the share of HBM bandwidth that elementwise kernels, norms and softmax sustain;
# launch: the host's cost per kernel the GPU waits on.
# Ampere: fitted once, jointly, to Korthikanti et al. 2022 Table 5 and Narayanan et al. 2021 Table 1
#   (Megatron-LM on Selene's A100 80 GB; ``cfx.bench estimate`` prints every row's error), then held:
#   a grid over these four numbers, the same for every row (refitted when Megatron's data-parallel
#   all-reduce was counted in fp16, as it runs, not fp32: matmul 0.76 -> 0.74, unfused attention 0.30 ->
#   0.35). cuBLAS's large fp16 GEMMs alone reach 0.8-0.9.
# Hopper: not fitted to a published run: the cuBLAS bf16 GEMM share (about 700 of 989 TF on large
#   shapes), FlashAttention-2's share on H100 (about 0.5 of peak forward), Ampere's memory share. Checked
#   against one measured H200 step (GPT-2 medium, docs/MEASURED.md; ``cfx.bench estimate``).
EFFICIENCY = {
    "ampere": dict(matmul=0.74, matmul_half=1.0e10, attention=0.55, attention_unfused=0.35, memory=0.75,
                   launch=4e-6),
    "hopper": dict(matmul=0.70, matmul_half=3.0e10, attention=0.50, attention_unfused=0.25, memory=0.80,
                   launch=4e-6),
}

# -- links: per GPU and direction ------------------------------------------------------------------
# efficiency: the bus bandwidth NCCL's ring collectives reach over the link's peak (nccl-tests'
# busbw on DGX systems: about 230 of 300 GB/s over NVLink 3, 360 of 450 over NVLink 4, 23 of 25 GB/s
# over HDR InfiniBand); latency: per ring step (NCCL's LL/Simple protocols: a few microseconds).
LINKS = {
    "nvlink3": dict(bandwidth=300 * GB, efficiency=0.77, latency=6e-6),   # A100 SXM4: 12 links x 25 GB/s
    "nvlink4": dict(bandwidth=450 * GB, efficiency=0.80, latency=6e-6),   # H100/H200 SXM: 18 links x 25 GB/s
    "hdr-ib": dict(bandwidth=25 * GB, efficiency=0.92, latency=12e-6),    # DGX A100: one 200 Gb/s HCA per GPU
    "ndr-ib": dict(bandwidth=50 * GB, efficiency=0.92, latency=12e-6),    # DGX H100: one 400 Gb/s HCA per GPU
    "pcie4": dict(bandwidth=25 * GB, efficiency=1.0, latency=10e-6),      # host <-> GPU, measured by bandwidthTest
    "pcie5": dict(bandwidth=50 * GB, efficiency=1.0, latency=10e-6),
}

# -- how a collective backend runs each collective, where it is not the ring of NCCL ---------------
# torch's ProcessGroupGloo reduces-and-scatters by an all-reduce, then keeps its own part (measured over
# two namespace hosts: reduce_scatter within 5% of all_reduce at 1-32 MiB; ``cfx.bench estimate``).
ALGORITHMS = {"nccl": {}, "gloo": {"reduce_scatter": "all_reduce"}}

# -- the presets: a node of 8 GPUs, its links, its host and disks (DGX A100 / DGX H100 / DGX H200) -----
# nvme: per node, sequential (DGX A100 and H100: 8 and 8 U.2 NVMe drives, about 25-50 GB/s in RAID 0;
# 25 GB/s is what one node reads back at once).
PRESETS = {
    "a100-40gb": dict(gpu="a100-40gb", gpus_per_node=8, intra="nvlink3", inter="hdr-ib", host="pcie4", nvme_bw=25 * GB),
    "a100-80gb": dict(gpu="a100-80gb", gpus_per_node=8, intra="nvlink3", inter="hdr-ib", host="pcie4", nvme_bw=25 * GB),
    "h100-80gb": dict(gpu="h100-80gb", gpus_per_node=8, intra="nvlink4", inter="ndr-ib", host="pcie5", nvme_bw=50 * GB),
    "h200": dict(gpu="h200", gpus_per_node=8, intra="nvlink4", inter="ndr-ib", host="pcie5", nvme_bw=50 * GB),
}

# -- software stacks: what the step's code does, beside what the GPU can ---------------------------
# attention: "flash" (a fused core over causal tiles: half the square computed, nothing of it kept) or
#   "unfused" (batched GEMMs and a softmax over the whole materialised square, its dropout's mask kept);
# tp_backward_overlap: the tensor-parallel collectives of backward hidden behind the weight-gradient GEMMs;
# p2p_split: a pipeline message sent as 1/t per tensor-parallel rank and all-gathered over NVLink;
# optimizer_bytes: HBM bytes the optimizer step moves per parameter (and gradient clipping with it);
# grad_reduce_bytes: bytes per gradient element the data-parallel reduction sends (None: the plan's own
#   accounting of its gradients).
STACKS = {
    # cfx: cfx.nn.attention (flash / SDPA), psum in backward when it is reached, whole messages between
    # stages; fp32 params and grads, AdamW reads p, g, m, v and writes p, m, v (7 x 4 bytes) + clipping's read.
    "cfx": dict(attention="flash", tp_backward_overlap=False, p2p_split=False, optimizer_bytes=32,
                grad_reduce_bytes=None),
    # Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran it: unfused softmax attention,
    # asynchronous tensor-parallel all-reduce / sequence-parallel all-gather in backward, the scatter-gather
    # pipeline optimisation; fp16 params, fp32 main grads and master weights: Adam reads g, p32, m, v and
    # writes p32, m, v, p16 (30 bytes), clipping and the inf check read the grads (8), zeroing writes them (4).
    # Its data-parallel all-reduce sends the gradients in the params' fp16 (2 bytes): fp32 only under
    # --accumulate-allreduce-grads-in-fp32, a switch off by default (megatron/arguments.py) and not among the
    # papers' flags.
    "megatron": dict(attention="unfused", tp_backward_overlap=True, p2p_split=True, optimizer_bytes=42,
                     grad_reduce_bytes=2),
}
