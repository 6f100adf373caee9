"""``python -m cfx.diffusion.sample --pipeline DIR --prompt "..." --steps 25 --out image.png``: text to
image with a Stable Diffusion pipeline directory (``--help`` for the flags; see
``cfx._src.diffusion.cli_sample``)."""
import sys

from cfx._src.diffusion.cli_sample import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
