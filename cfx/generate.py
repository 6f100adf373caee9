"""``cfx.generate(model, params, prompt, max_new_tokens=...)`` (see ``cfx._src.generate.decode``) and its
command line, which streams text as it is decoded (see ``cfx._src.train.cli_generate``)::

    python -m cfx.generate --checkpoint DIR --prompt "def main(" --max-new-tokens 64
    python -m cfx.generate --checkpoint DIR --prompt "..." --mesh model=2 --int8 --temperature 0.8

This module is callable as the function: ``cfx.generate(...)`` and ``python -m cfx.generate`` are
one name.
"""
import sys

from cfx._src.core.modules import callable_module
from cfx._src.generate.compiled import compiled_graphs
from cfx._src.generate.decode import generate
from cfx._src.nn.kv_cache import KVCache
from cfx._src.train.cli_generate import main, parse_args

__all__ = ["KVCache", "compiled_graphs", "generate", "main", "parse_args"]

callable_module(__name__, generate)

if __name__ == "__main__":
    sys.exit(main())
