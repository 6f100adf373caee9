"""The main job: ``python -m cfx.train`` trains a language model on byte-level text.

    python -m cfx.train --model gpt2 --preset tiny --steps 300 --precision bf16
"""
from __future__ import annotations

import sys
from typing import Sequence

from cfx._src.core.runtime import keep_host_memory
from cfx._src.train.config import TrainConfig, parse_args
from cfx._src.train.loop import make_train_step, train

__all__ = ["TrainConfig", "main", "make_train_step", "parse_args", "train"]


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    keep_host_memory()  # reuse freed pages across steps (see cfx._src.core.runtime)
    try:
        train(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
