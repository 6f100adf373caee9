"""``python -m cfx.serve``: an OpenAI-compatible HTTP server on the serving engine.

    python -m cfx.serve --model DIR [--mesh model=2] [--int8] [--lora NAME=DIR ...] [--host 127.0.0.1] [--port 8000]
                        [--kv-bytes 2GiB] [--max-waiting 256] [--block-size 16] [--max-batch-tokens 512]
                        [--max-seqs 64]

``DIR`` is a Hugging Face model directory (its tokenizer and chat template; bytes where it has no
tokenizer) or a ``python -m cfx.train --save`` checkpoint (``cli_generate.load`` reads both); each
``--lora NAME=DIR`` (a peft adapter directory) is served beside it as the model ``NAME``. The
engine steps in its own thread (``cfx._src.serve.runner``) beside uvicorn's event loop; SIGTERM or
Ctrl-C stops taking connections, finishes the requests in flight and exits 0. ``--mesh model=N``
splits the heads over N rank threads of this process, or, launched by ``torchrun --nproc-per-node
N -m cfx.serve ...``, over N processes: rank 0 serves HTTP and schedules, every rank steps
(``cfx._src.serve.ranks``), and SIGTERM to rank 0 (or to torchrun, which passes it on) drains and
stops them all. Clients speak OpenAI's API (``cfx._src.serve.http``)::

    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "cfx", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
from typing import Any, Sequence

from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.core.text import parse_bytes
from cfx._src.lora.peft import load_peft
from cfx._src.mesh.mesh import Mesh
from cfx._src.plan.config import parse_mesh
from cfx._src.precision.quant import quantize
from cfx._src.serve import ranks
from cfx._src.serve.engine import Engine
from cfx._src.serve.http import app as make_app
from cfx._src.serve.runner import EngineThread
from cfx._src.train.cli_generate import load


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = command_parser("python -m cfx.serve", __doc__)
    p.add_argument("--model", required=True, help="a Hugging Face directory or a python -m cfx.train checkpoint")
    p.add_argument("--name", default=None, help="the model's name in requests and /v1/models (default: the "
                   "directory's name)")
    p.add_argument("--mesh", default=None, help="tensor parallelism over rank threads (or torchrun's processes), e.g. "
                   "model=2 (each rank computes and caches its heads)")
    p.add_argument("--int8", action="store_true", help="weight-only int8 params (cfx.quant.quantize)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a peft LoRA directory as the model NAME (repeatable; requests name it)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-bytes", default="256MiB", help="the KV cache's pool (e.g. 2GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens computed per engine step")
    p.add_argument("--max-seqs", type=int, default=64, help="sequences running at once")
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting before new ones get 429")
    return parse(p, argv)


def build(args: argparse.Namespace, mesh: Any = None) -> tuple[Any, EngineThread, str]:
    """The ASGI app, its engine thread and the model's name, from the command's arguments (``mesh``:
    the one ``--mesh`` names, open)."""
    engine, tok = build_engine(args, mesh)
    runner = EngineThread(engine, max_waiting=args.max_waiting)
    name = args.name or os.path.basename(os.path.normpath(args.model))
    return make_app(runner, tok, model_name=name), runner, name


def build_engine(args: argparse.Namespace, mesh: Any = None) -> tuple[Engine, Any]:
    """The engine (with its adapters) and the tokenizer the arguments name."""
    model, params, tok = load(args.model)
    if args.int8:
        params = quantize(params, "int8", axes=model.axes())
    tok.skip_special = True  # what a client reads is text
    engine = Engine(model, params, block_size=args.block_size, kv_bytes=parse_bytes(args.kv_bytes),
                    max_batch_tokens=args.max_batch_tokens, max_seqs=args.max_seqs, mesh=mesh)
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=DIR (a peft adapter directory).")
        config, adapters = load_peft(path, model)
        engine.add_adapter(name, adapters, config)
    return engine, tok


def run(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        mesh = None
        if args.mesh is not None:
            (_, n), = parse_mesh(args.mesh, axes=("model",), fix="; the server splits heads over one axis, e.g. "
                                 "--mesh model=2.")
            mesh = stack.enter_context(Mesh({"model": n}))
        engine, tok = build_engine(args, mesh)
        if not ranks.leads(engine):  # torchrun's ranks 1..: step with rank 0 until it stops serving
            for sig in (signal.SIGINT, signal.SIGTERM):  # (torchrun passes its signals on: rank 0 decides)
                signal.signal(sig, lambda s, f: None)
            ranks.follow(engine)
            return
        runner = EngineThread(engine, max_waiting=args.max_waiting)
        name = args.name or os.path.basename(os.path.normpath(args.model))
        try:
            serve(args, make_app(runner, tok, model_name=name), runner, name)
        finally:
            ranks.stop_followers(engine)


def serve(args: argparse.Namespace, app: Any, runner: EngineThread, name: str) -> None:
    """Run uvicorn until SIGTERM / Ctrl-C, then finish the requests in flight."""
    import uvicorn

    engine = runner.engine
    ranks = "" if engine.run.mesh is None else f"; heads over {engine.run.n} ranks" + (
        ", rank 0 serving, every rank stepping" if engine.run.control is not None else " (threads)")
    print(f"cfx.serve: {name!r} on http://{args.host}:{args.port}/v1 ({engine.blocks.num_blocks} KV blocks "
          f"of {args.block_size} tokens{ranks}; pid {os.getpid()})", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn handles them while it serves, then raises the one it
        signal.signal(sig, lambda s, f: None)    # stopped on again: to this no-op, so the command exits 0
    try:
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")).run()
    finally:  # uvicorn has stopped taking connections and finished those open
        runner.close(drain=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv)
