"""``python -m cfx.diffusion.dreambooth --pipeline DIR --instance-dir DIR --instance-prompt P --class-prompt P --out DIR``:
DreamBooth with prior preservation, as diffusers' ``train_dreambooth.py`` (``--lora r=4,alpha=4``:
``train_dreambooth_lora.py``, writing diffusers' LoRA file; ``--help`` for the flags; see
``cfx._src.diffusion.cli_dreambooth``)."""
import sys

from cfx._src.diffusion.cli_dreambooth import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
