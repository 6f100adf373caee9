"""``python -m cfx.bench NAME [--quick | --smoke] [--json FILE]``."""
from __future__ import annotations

import argparse
import sys

from cfx._src.core.runtime import keep_host_memory
from cfx.bench import autoshard, capacity, checkpoint, diffusion, estimate, evoformer, fp8, gemini, generate, gpu, gpu_all, kernels, large_batch, lora, memory, moe, overhead, pipeline, plans, remat, sequence, serve, serve_http, spmd, tensor_parallel, zero

BENCHES = {"autoshard": autoshard.run, "capacity": capacity.run, "checkpoint": checkpoint.run, "diffusion": diffusion.run, "estimate": estimate.run, "evoformer": evoformer.run, "fp8": fp8.run, "gemini": gemini.run, "generate": generate.run, "gpu": gpu.run, "kernels": kernels.run, "large_batch": large_batch.run, "lora": lora.run, "memory": memory.run, "moe": moe.run, "overhead": overhead.run, "pipeline": pipeline.run, "plans": plans.run, "remat": remat.run, "sequence": sequence.run, "serve": serve.run, "spmd": spmd.run, "tensor_parallel": tensor_parallel.run, "zero": zero.run}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cfx.bench", description=__doc__)
    p.add_argument("name", choices=sorted(BENCHES))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="finish in under a minute on 2 CPU cores")
    size.add_argument("--smoke", action="store_true",
                      help="every code path once at toy sizes, in seconds (the test suite's check; the "
                           "figures mean nothing)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--http", action="store_true", help="serve: measure the HTTP server under load instead")
    p.add_argument("--all", action="store_true",
                   help="gpu: every GPU figure and gpu-marked test in one device lease (cfx.bench.gpu_all)")
    p.add_argument("--cap", default=None, help="capacity: the memory cap of every candidate (default 2GiB)")
    p.add_argument("--dir", default=None, help="capacity: where the offloaded state's files go (a disk, not tmpfs)")
    a = p.parse_args(argv)
    if (a.cap or a.dir) and a.name != "capacity":
        p.error("--cap and --dir are the capacity bench's (python -m cfx.bench capacity --cap 2GiB --dir DIR)")
    if a.http and a.name != "serve":
        p.error("--http is the serve bench's (python -m cfx.bench serve --http)")
    if a.all and (a.name != "gpu" or a.quick):
        p.error("--all is the gpu bench's, at its own sizes (python -m cfx.bench gpu --all [--smoke])")
    keep_host_memory()  # the same setting as python -m cfx.train; applies to both sides of a comparison
    if a.all:
        gpu_all.run_all(smoke=a.smoke, json_path=a.json)
        return 0
    if a.name == "capacity":
        capacity.run(quick=a.quick, smoke=a.smoke, json_path=a.json, cap=a.cap, directory=a.dir)
        return 0
    bench = serve_http.run_http if a.http else BENCHES[a.name]
    bench(quick=a.quick, smoke=a.smoke, json_path=a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
