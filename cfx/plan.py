"""``python -m cfx.plan``: a plan's step time, MFU and memory per GPU on a cluster, or the best plans
for one (``cfx.parallel.estimate`` / ``cfx.parallel.search``).

    python -m cfx.plan --cluster h100-80gb:1024 --model gpt2 --preset xl --batch 1024 --seq 1024
"""
import sys

from cfx._src.estimate.cli_plan import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
