"""``python -m cfx.plan``: the best plans for a cluster one does not have.

    python -m cfx.plan --cluster h100-80gb:1024 --model gpt2 --preset xl --batch 1024 --seq 1024
    python -m cfx.plan --cluster a100-80gb:64 --model gpt2 --preset xl --batch 64 --seq 1024 \\
        --plan "pipe=8,model=8 remat=dots sp=megatron microbatches=64"

Without ``--plan`` it searches every plan over pipe x data x seq x model (``search``) and prints the
fastest that fit, with step time, MFU and memory per GPU; with ``--plan`` it estimates that one plan and
prints where its time and memory go. ``--model`` / ``--preset`` are ``python -m cfx.train``'s (fields
after commas override a preset: ``--preset xl,n_embd=12288,n_layer=96,n_head=96``).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.core.text import format_bytes, format_table
from cfx._src.estimate.cluster import Cluster
from cfx._src.estimate.estimate import estimate
from cfx._src.estimate.search import search
from cfx._src.models import families
from cfx._src.plan.plan import Plan


def parse_args(argv: Sequence[str] | None = None):
    p = command_parser("python -m cfx.plan", "Estimate a training plan's step time, MFU and memory per GPU on a "
                       "cluster (a preset and a GPU count), or search for the best plans.")
    p.add_argument("--cluster", required=True, help="PRESET:GPUS (a100-40gb, a100-80gb, h100-80gb, h200), or a "
                   "cluster's JSON file (cfx.parallel.Cluster.to_json)")
    p.add_argument("--model", default="gpt2", help="a model family, as python -m cfx.train takes it")
    p.add_argument("--preset", default="small", help="its size preset; fields after commas override it")
    p.add_argument("--batch", type=int, required=True, help="global batch, in rows")
    p.add_argument("--seq", type=int, required=True, help="tokens per row")
    p.add_argument("--plan", default=None, help="estimate this plan only (Plan.parse's text)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"), help="compute dtype of the search")
    p.add_argument("--top", type=int, default=5, help="plans to print")
    p.add_argument("--json", default=None, help="write the estimates as JSON here")
    return parse(p, argv)


def build_model(args) -> Any:
    return families.named(args.model, "--model").preset(args.preset)


def run(args) -> Any:
    if args.batch < 1 or args.seq < 1 or args.top < 1:
        raise ValueError("--batch, --seq and --top are positive integers.")
    cluster = Cluster.parse(args.cluster)
    model = build_model(args)
    if args.plan is not None:
        return [estimate(model, Plan.parse(args.plan), cluster, batch=(args.batch, args.seq))], None
    found = search(model, cluster, batch=(args.batch, args.seq), top=args.top, precision=args.precision)
    if not found.best:
        raise ValueError(f"no plan of {found.searched:,} fits {args.model} {args.preset!r} with a batch of "
                         f"{args.batch} x {args.seq} on {cluster}; use more GPUs, a smaller batch or a larger GPU.")
    return found.best, found


def report(args, result) -> None:
    best, found = result
    if found is None:
        print(best[0])
    else:
        rows = [(e.plan, f"{e.step_s:.3g}", f"{e.mfu:.1%}", f"{e.tflops_per_gpu:.0f}", format_bytes(e.memory_bytes))
                for e in best]
        print(format_table(rows, ["plan", "step s", "MFU", "TFLOP/s/GPU", "memory/GPU"]))
        print(f"\n{found.searched:,} plans estimated in {found.seconds:.1f} s, {found.fitting:,} fit "
              f"{format_bytes(best[0].capacity)} per GPU; the best {len(best)} shown (python -m cfx.plan --plan "
              "'...' breaks one down).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"plan": e.plan, "cluster": e.cluster, "step_s": e.step_s, "mfu": e.mfu, "hfu": e.hfu,
                        "tflops_per_gpu": e.tflops_per_gpu, "memory_bytes": e.memory_bytes, "fits": e.fits,
                        "memory": e.memory, "breakdown": e.breakdown} for e in best], f, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv, report=report)
