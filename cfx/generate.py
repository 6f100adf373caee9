"""``cfx.generate(model, params, prompt, max_new_tokens=...)`` (see ``cfx._src.generate.decode``) and its
command line, which streams text as it is decoded::

    python -m cfx.generate --checkpoint DIR --prompt "def main(" --max-new-tokens 64
    python -m cfx.generate --checkpoint DIR --prompt "..." --mesh model=2 --int8 --temperature 0.8

``--checkpoint``: a Hugging Face directory (``cfx.models.save_pretrained``'s or ``transformers``'
``save_pretrained``'s; its tokenizer is used when it has one, bytes otherwise) or what
``python -m cfx.train --save`` wrote (a byte-level model): a file, or the directory of a run on a
mesh under any plan. ``--mesh model=N`` decodes
tensor-parallel over N local ranks (or torchrun processes); ``--int8`` quantizes the Linear
weights first (``cfx.quant.quantize``).

This module is callable as the function: ``cfx.generate(...)`` and ``python -m cfx.generate`` are
one name.
"""
from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any, Sequence

from cfx._src.generate.decode import generate
from cfx._src.nn.kv_cache import KVCache

__all__ = ["KVCache", "generate", "main"]


class _Callable(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cfx.generate", description="Stream text from a cfx or HF model.")
    p.add_argument("--checkpoint", required=True, help="a Hugging Face directory, or a cfx.train checkpoint (file or directory)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    p.add_argument("--eos-id", type=int, default=None, help="stop at this token id (default: the tokenizer's eos)")
    p.add_argument("--mesh", default=None, help="model=N: tensor-parallel decoding over N ranks")
    p.add_argument("--int8", action="store_true", help="int8 weight-only Linear layers")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> str:
    """Load, decode and stream ``args.prompt``'s continuation to stdout; returns the new text."""
    import torch

    import cfx
    model, params, codec = _load(args.checkpoint)
    prompt = torch.tensor([codec.encode(args.prompt)], dtype=torch.long)
    eos = args.eos_id if args.eos_id is not None else codec.eos_id
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              key=cfx.random.key(args.seed), eos_id=eos)
    stream = _Stream(codec)
    if args.mesh is None:
        if args.int8:
            params = cfx.quant.quantize(params, "int8")
        cfx.generate(model, params, prompt, on_token=stream, **kw)
    else:
        n = _model_axis(args.mesh)
        tp = cfx.parallel.tensor_parallel(model, "model")
        with cfx.Mesh({"model": n}) as mesh:
            specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
            tp.blocks[0].check(n)

            def body(p, x):
                p = cfx.quant.quantize(p, "int8") if args.int8 else p
                first = cfx.lax.axis_index("model") == 0  # one rank streams
                return cfx.generate(tp, p, x, on_token=stream if first else None, **kw)
            cfx.shard_map(body, mesh=mesh, in_specs=(specs, cfx.P()), out_specs=cfx.P())(params, prompt)
    print(flush=True)
    return stream.text


class _Stream:
    """Prints each new token's text as it comes (decoding the whole continuation each time, so
    multi-token characters come out whole)."""

    def __init__(self, codec):
        self.codec, self.ids, self.text = codec, [], ""

    def __call__(self, tokens) -> None:
        self.ids.append(int(tokens[0]))
        text = self.codec.decode(self.ids)
        print(text[len(self.text):], end="", flush=True)
        self.text = text


class _Bytes:
    eos_id = None

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8")) or [10]

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="ignore")


class _HFTokenizer:
    def __init__(self, tok):
        self.tok, self.eos_id = tok, tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _load(path: str) -> tuple[Any, Any, Any]:
    """``(model, params, codec)`` from an HF directory or a cfx.train checkpoint (a file, or a
    sharded directory)."""
    import cfx
    if os.path.isfile(os.path.join(path, "index.json")):  # a sharded checkpoint of python -m cfx.train
        return _load_train_dir(path)
    if os.path.isdir(path):
        model, params = cfx.models.from_pretrained(path)
        has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json",
                                                                            "tokenizer.model"))
        if has_tokenizer:
            import transformers
            return model, params, _HFTokenizer(transformers.AutoTokenizer.from_pretrained(path))
        return model, params, _bytes_for(model, path)
    if not os.path.isfile(path):
        raise ValueError(f"--checkpoint {path!r}: no such file or directory.")
    import json

    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        model = _train_model(path, json.loads((f.metadata() or {}).get("cfx", "{}")))
        items, treedef = cfx.tree.flatten_with_path(cfx.eval_shape(model.init, cfx.random.key(0)))
        params = cfx.tree.unflatten(treedef, [f.get_tensor(f"params.{p}") for p, _ in items])
    return model, params, _bytes_for(model, path)


def _load_train_dir(path: str) -> tuple[Any, Any, Any]:
    """A directory ``python -m cfx.train --mesh ... --save DIR`` wrote (any plan: its params are
    stored in the model's own coordinates), read as whole tensors."""
    import cfx
    from cfx._src.checkpoint.sharded import Stored
    with Stored(path) as stored:
        model = _train_model(path, stored.metadata)
        items, treedef = cfx.tree.flatten_with_path(cfx.eval_shape(model.init, cfx.random.key(0)))
        params = cfx.tree.unflatten(treedef, [stored.region(f"params.{p}", (0,) * x.dim(), tuple(x.shape))
                                              for p, x in items])
    return model, params, _bytes_for(model, path)


def _train_model(path: str, meta: dict) -> Any:
    """The model a cfx.train checkpoint's metadata describes."""
    from cfx._src.train.config import TrainConfig
    from cfx._src.train.loop import build_model
    if "config" not in meta:
        raise ValueError(f"--checkpoint {path!r}: not a python -m cfx.train checkpoint (no training config in "
                         "its metadata); pass a Hugging Face directory instead.")
    fields = {k: v for k, v in meta["config"].items() if k in TrainConfig.__dataclass_fields__}
    return build_model(TrainConfig(**fields))


def _bytes_for(model: Any, path: str) -> _Bytes:
    if model.config.vocab_size < 256:
        raise ValueError(f"--checkpoint {path!r} has no tokenizer and a vocabulary of {model.config.vocab_size} "
                         "(< 256 bytes); save the tokenizer into the directory (tokenizer.save_pretrained).")
    return _Bytes()


def _model_axis(text: str) -> int:
    name, _, size = text.partition("=")
    if name.strip() != "model" or not size.strip().isdigit() or int(size) < 1:
        raise ValueError(f"--mesh {text!r}: generation splits heads over one axis, e.g. --mesh model=2.")
    return int(size)


if __name__ == "__main__":
    sys.exit(main())
