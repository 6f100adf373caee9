"""``python -m cfx.generate``: stream text from a checkpoint as ``cfx.generate`` decodes it.

    python -m cfx.generate --checkpoint DIR --prompt "def main(" --max-new-tokens 64
    python -m cfx.generate --checkpoint DIR --prompt "..." --mesh model=2 --int8 --temperature 0.8

``--checkpoint``: a Hugging Face directory (``cfx.models.save_pretrained``'s or ``transformers``'
``save_pretrained``'s; its tokenizer is used when it has one, bytes otherwise) or what
``python -m cfx.train --save`` wrote (a byte-level model): a file, or the directory of a run on a
mesh under any plan (``saving.read_params``; hence this command lives with the training job).
``--mesh model=N`` decodes tensor-parallel over N local ranks (or torchrun processes); ``--int8``
quantizes the Linear weights first (``cfx.quant.quantize``).
"""
from __future__ import annotations

import argparse
import codecs
import os
from typing import Any, Sequence

import torch

from cfx._src.core import random as jr
from cfx._src.generate.decode import generate
from cfx._src.lax.collectives import axis_index
from cfx._src.mesh.mesh import Mesh
from cfx._src.mesh.spec import P
from cfx._src.models.hf_dir import from_pretrained
from cfx._src.models.parts import vocab_size
from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
from cfx._src.parallel.rules import Rules
from cfx._src.core.cli import command_parser, parse, run_command
from cfx._src.plan.config import parse_mesh
from cfx._src.precision.quant import quantize
from cfx._src.spmd.shard_map import shard_map
from cfx._src.serve.tokens import ByteTokenizer, HFTokenizer
from cfx._src.train.saving import read_params
from cfx._src.core.text import printable


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = command_parser("python -m cfx.generate", "Stream text from a cfx or HF model.")
    p.add_argument("--checkpoint", required=True, help="a Hugging Face directory, or a cfx.train checkpoint (file or directory)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, help="sample among the likeliest tokens whose probability reaches p (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    p.add_argument("--eos-id", type=int, default=None, help="stop at this token id (default: the tokenizer's eos)")
    p.add_argument("--mesh", default=None, help="model=N: tensor-parallel decoding over N ranks")
    p.add_argument("--int8", action="store_true", help="int8 weight-only Linear layers")
    return parse(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args, run, argv, report=lambda args, text: print(flush=True))


def run(args: argparse.Namespace) -> str:
    """Load, decode and stream ``args.prompt``'s continuation to stdout; returns the new text."""
    mesh = parse_mesh(args.mesh, axes=("model",), fix="; generation splits heads over one axis, e.g. --mesh "
                      "model=2.") if args.mesh is not None else ()
    model, params, codec = load(args.checkpoint)
    prompt = torch.tensor([codec.encode(args.prompt) or [10]], dtype=torch.long)  # nothing: a newline
    eos = args.eos_id if args.eos_id is not None else codec.eos_id
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              key=jr.key(args.seed), eos_id=eos)
    stream = _Stream(codec)
    if not mesh:
        generate(model, quantize(params, "int8", axes=model.axes()) if args.int8 else params, prompt, on_token=stream, **kw)
        return stream.finish()
    (_, n), = mesh
    tp = tensor_parallel(model, "model")
    with Mesh({"model": n}) as m:
        specs = Rules(MEGATRON_RULES).specs(model.axes(), mesh=m)
        tp.blocks[0].check(n)

        def body(p, x):
            p = quantize(p, "int8", axes=tp.axes()) if args.int8 else p
            first = axis_index("model") == 0  # one rank streams
            return generate(tp, p, x, on_token=stream if first else None, **kw)
        shard_map(body, mesh=m, in_specs=(specs, P()), out_specs=P())(params, prompt)
    return stream.finish()


class _Stream:
    """Prints each new token's text as it comes (decoding the whole continuation each time, so
    multi-token characters come out whole)."""

    def __init__(self, codec):
        self.codec, self.ids, self.text = codec, [], ""
        # bytes: decoded as they come (a character split over tokens appears once it is whole)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if isinstance(codec, ByteTokenizer) else None

    def __call__(self, tokens) -> None:
        token = int(tokens[0])
        if self.utf8 is not None:
            piece = self.utf8.decode(bytes([token]) if token < 256 else b"")
        else:
            self.ids.append(token)
            piece = self.codec.decode(self.ids)[len(self.text):]
        self.text += piece
        print(printable(piece), end="", flush=True)

    def finish(self) -> str:
        """The text, a character cut off by the last token shown as U+FFFD."""
        if self.utf8 is not None:
            piece = self.utf8.decode(b"", final=True)
            self.text += piece
            print(printable(piece), end="", flush=True)
        return self.text


def load(path: str) -> tuple[Any, Any, Any]:
    """``(model, params, codec)`` from an HF directory or a cfx.train checkpoint (a file, or a
    sharded directory)."""
    if os.path.isfile(os.path.join(path, "index.json")):  # a sharded checkpoint of python -m cfx.train
        model, params = read_params(path)
        return model, params, _bytes_for(model, path)
    if os.path.isdir(path):
        model, params = from_pretrained(path)
        has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json",
                                                                            "tokenizer.model"))
        if has_tokenizer:
            import transformers
            return model, params, HFTokenizer(transformers.AutoTokenizer.from_pretrained(path))
        return model, params, _bytes_for(model, path)
    if not os.path.isfile(path):
        raise ValueError(f"--checkpoint {path!r}: no such file or directory.")
    model, params = read_params(path)
    return model, params, _bytes_for(model, path)


def _bytes_for(model: Any, path: str) -> ByteTokenizer:
    if vocab_size(model) < 256:
        raise ValueError(f"--checkpoint {path!r} has no tokenizer and a vocabulary of {vocab_size(model)} "
                         "(< 256 bytes); save the tokenizer into the directory (tokenizer.save_pretrained).")
    return ByteTokenizer()
