"""``cfx.generate``: decode new tokens after a batch of prompts, with a preallocated KV cache.

    out = cfx.generate(model, params, prompt, max_new_tokens=32)             # greedy
    out = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=32,  # left-padded prompts,
                       temperature=0.8, top_k=50, top_p=0.95, key=key)      # sampled

The prompts are run once, filling a ``KVCache`` (``cfx.nn.KVCache``) for ``prompt + max_new_tokens``
positions; then each step feeds only the newest token. Prompts of different lengths are
left-padded with ``mask`` (bool ``(B, T)``, False = padding): positions count the real tokens
(``cumsum(mask) - 1``, as Hugging Face's ``generate`` numbers them) and padded keys are hidden.
Greedy decoding (``temperature=0``) picks the argmax; otherwise the logits are divided by
``temperature``, cut to the ``top_k`` largest and to the smallest set whose probability reaches
``top_p``, and sampled with ``cfx.random`` (step ``i`` draws with ``fold_in(key, i)``: the same key
gives the same text on every rank). A row that emits ``eos_id`` is finished: it is padded with
``pad_id`` (default ``eos_id``) and generation stops early once every row is.

Inside ``shard_map`` with a tensor-parallel model (``cfx.parallel.tensor_parallel``) each rank
caches its own heads and the vocabulary-parallel logits are gathered before picking, so every
rank produces the same tokens. Params may be int8 (``cfx.quantize``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from cfx._src.core import random as jr
from cfx._src.lax import collectives as lax
from cfx._src.nn.kv_cache import KVCache


@torch.no_grad()
def generate(model: Any, params: Any, prompt: torch.Tensor, *, max_new_tokens: int,
             mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, key: torch.Tensor | None = None, eos_id: int | None = None,
             pad_id: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """``(B, T + n)`` tokens: the prompts ``(B, T)`` and up to ``max_new_tokens`` new ones (module doc).
    ``on_token(tokens (B,))`` is called with each step's tokens as they come (streaming)."""
    B, T = _check(model, prompt, mask, max_new_tokens, temperature, top_k, top_p, key)
    mask = torch.ones(B, T, dtype=torch.bool, device=prompt.device) if mask is None else mask.to(torch.bool)
    cache = KVCache(B, T + max_new_tokens, len(model.blocks), device=prompt.device)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T): real tokens count from 0
    logits = model.apply(params, prompt, mask=mask, positions=positions, cache=cache)[:, -1]  # (B, V)
    nxt_pos = mask.long().sum(1, keepdim=True)  # (B, 1): the next token's position
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    pad = eos_id if pad_id is None else pad_id
    out = [prompt]
    for i in range(max_new_tokens):
        tok = _pick(_whole_vocab(model, logits), temperature, top_k, top_p,
                    None if key is None else jr.fold_in(key, i))  # (B,)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            done = done | (tok == eos_id)
        out.append(tok[:, None])
        if on_token is not None:
            on_token(tok)
        if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        logits = model.apply(params, tok[:, None], positions=nxt_pos, cache=cache)[:, -1]
        nxt_pos = nxt_pos + 1
    return torch.cat(out, dim=1)


def _whole_vocab(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole vocabulary (fp32): a vocabulary-parallel model's shards gathered."""
    axis = getattr(model, "vocab_axis", None)
    if axis is not None:
        logits = lax.all_gather(logits, axis, dim=-1, tiled=True)
    return logits.float()


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
          key: torch.Tensor | None) -> torch.Tensor:
    # logits (B, V) -> tokens (B,)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        order = logits.argsort(-1, descending=True)
        probs = logits.gather(-1, order).softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # beyond the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(drop, float("-inf")))
    return jr.categorical(key, logits)


def _check(model, prompt, mask, max_new_tokens, temperature, top_k, top_p, key) -> tuple[int, int]:
    where = "cfx.generate"
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise ValueError(f"{where}: prompt must be an integer (B, T) tensor of token ids, got "
                         f"{getattr(prompt, 'shape', type(prompt).__name__)}.")
    B, T = prompt.shape
    if mask is not None and tuple(mask.shape) != (B, T):
        raise ValueError(f"{where}: mask has shape {tuple(mask.shape)}, but the prompt is {(B, T)}.")
    if mask is not None and not bool(mask.to(torch.bool).any(1).all()):
        raise ValueError(f"{where}: a prompt row has no real token (its mask is all False); give each row one.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be a positive int, got {max_new_tokens!r}.")
    name = getattr(model, "max_len_name", None)
    limit = getattr(getattr(model, "config", None), name, None) if name else None
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(f"{where}: {T} prompt + {max_new_tokens} new tokens exceed the model's {name}={limit}; "
                         f"generate at most {limit - T} tokens or shorten the prompt.")
    if temperature < 0:
        raise ValueError(f"{where}: temperature must be >= 0 (0 is greedy), got {temperature}.")
    if temperature > 0 and key is None:
        raise ValueError(f"{where}: sampling (temperature={temperature}) needs key=cfx.random.key(seed).")
    if top_k is not None and top_k < 1 or top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"{where}: top_k must be >= 1 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}.")
    if getattr(model, "seq", None) is not None:
        raise ValueError(f"{where}: the model splits its sequence over a mesh axis; generate with the unsplit "
                         "(or tensor-parallel) model.")
    return B, T
