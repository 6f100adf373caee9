"""``python -m cfx.diffusion.train --pipeline DIR --data DIR_OF_IMAGES_WITH_CAPTIONS --out DIR``: fine-tunes
a Stable Diffusion pipeline's UNet on captioned images under a ``cfx.parallel.Plan`` (``--help`` for
the flags; see ``cfx._src.diffusion.cli_train``)."""
import sys

from cfx._src.diffusion.cli_train import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
