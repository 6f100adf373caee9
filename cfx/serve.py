"""``cfx.serve``: many requests decoded at once -- a paged KV cache with prefix caching, continuous
batching with chunked prefill and preemption, every request token-exact with ``cfx.generate`` on
its own (see ``cfx._src.serve.engine``) -- and an OpenAI-compatible HTTP server on it::

    engine = cfx.serve.Engine(model, params, kv_bytes=256 << 20)
    outs = engine.generate(prompts, cfx.serve.SamplingParams(max_tokens=64))

    python -m cfx.serve --model DIR --port 8000      # POST /v1/completions, /v1/chat/completions

``cfx.serve.app(cfx.serve.EngineThread(engine), tokenizer)`` is the server's ASGI app, to mount in
a service of one's own.
"""
import sys

from cfx._src.serve.blocks import BlockAllocator, OutOfBlocks, block_hash
from cfx._src.serve.engine import Engine
from cfx._src.serve.http import app
from cfx._src.serve.paged import KVPool, PagedStep
from cfx._src.serve.ranks import follow, stop_followers
from cfx._src.serve.request import SamplingParams, StepOutput
from cfx._src.serve.runner import EngineThread
from cfx._src.serve.tokens import ByteTokenizer, HFTokenizer
from cfx._src.train.cli_serve import main, parse_args

__all__ = ["BlockAllocator", "ByteTokenizer", "Engine", "EngineThread", "HFTokenizer", "KVPool", "OutOfBlocks",
           "PagedStep", "SamplingParams", "StepOutput", "app", "block_hash", "follow", "main", "parse_args",
           "stop_followers"]

if __name__ == "__main__":
    sys.exit(main())
