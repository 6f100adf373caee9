"""The main job: ``python -m cfx.train`` trains a language model on byte-level text.

    python -m cfx.train --model gpt2 --preset tiny --steps 300 --precision bf16

``train(TrainConfig(...))`` runs it from Python and returns its summary; ``main(argv)`` is the
command line (``parse_args`` reads its flags).
"""
import sys

from cfx._src.train.cli_train import main, parse_args
from cfx._src.train.config import TrainConfig
from cfx._src.train.local import make_train_step
from cfx._src.train.loop import train

__all__ = ["TrainConfig", "main", "make_train_step", "parse_args", "train"]

if __name__ == "__main__":
    sys.exit(main())
