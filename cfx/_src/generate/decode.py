"""``cfx.generate``: decode new tokens after a batch of prompts, with a preallocated KV cache.

    out = cfx.generate(model, params, prompt, max_new_tokens=32)             # greedy
    out = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=32,  # left-padded prompts,
                       temperature=0.8, top_k=50, top_p=0.95, key=key)      # sampled

The prompts are run once, filling a ``KVCache`` (``cfx.nn.KVCache``) for ``prompt + max_new_tokens``
positions; then each step feeds only the newest token. Prompts of different lengths are
left-padded with ``mask`` (bool ``(B, T)``, False = padding): positions count the real tokens
(``cumsum(mask) - 1``, as Hugging Face's ``generate`` numbers them) and padded keys are hidden.
Each step's token is picked by ``pick.Sampling`` (greedy at ``temperature=0``; otherwise
``temperature``, ``top_k``, ``top_p`` and ``cfx.random`` with ``fold_in(key, i)`` at step ``i``: the
same key gives the same text on every rank) in ``decode_steps``, the loop ``sample_bytes`` runs too.
A row that emits ``eos_id`` is finished: it is padded with ``pad_id`` (default ``eos_id``) and
generation stops early once every row is.

Inside ``shard_map`` with a tensor-parallel model (``cfx.parallel.tensor_parallel``) each rank
caches its own heads and the vocabulary-parallel logits are gathered before picking, so every
rank produces the same tokens. Params may be int8 (``cfx.quantize``).

Each decode step only runs the model: the prefill's checks cover the steps (``KVCache.validated``),
tokens are picked on the device, and nothing reads a value back to the host -- except, with
``eos_id``, whether every row has finished, asked every ``EOS_POLL`` steps (the steps past the
last row's end are cut from the output, which is the same as stopping at once) and, with
``on_token``, the tokens it is handed. ``compile=True`` decodes with static shapes under
``torch.compile`` (``cfx._src.generate.compiled``): the same tokens, one graph for every step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from cfx._src.generate.pick import Sampling
from cfx._src.nn.kv_cache import KVCache
from cfx._src.models.parts import hook, sequence_part


EOS_POLL = 8  # steps between the host's looks at whether every row has emitted eos


@torch.no_grad()
def generate(model: Any, params: Any, prompt: torch.Tensor, *, max_new_tokens: int,
             mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, key: torch.Tensor | None = None, eos_id: int | None = None,
             pad_id: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None,
             compile: bool | str = False) -> torch.Tensor:
    """``(B, T + n)`` tokens: the prompts ``(B, T)`` and up to ``max_new_tokens`` new ones (module doc).
    ``on_token(tokens (B,))`` is called with each step's tokens as they come (streaming).
    ``compile``: True compiles the decode step with inductor (a string names another
    ``torch.compile`` backend); the tokens are the same."""
    sampling = Sampling(temperature, top_k, top_p, key)
    B, T = _check(model, prompt, mask, max_new_tokens, sampling)
    if compile:
        from cfx._src.generate import compiled

        logits, advance = compiled.start(model, params, prompt, mask, max_new_tokens,
                                         "inductor" if compile is True else compile)
    else:
        logits, advance = _start(model, params, prompt, mask, max_new_tokens)
    new = decode_steps(model, logits, advance, sampling, steps=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                       on_token=on_token)
    return torch.cat([prompt, torch.stack(new, 1)], dim=1)


def _start(model: Any, params: Any, prompt: torch.Tensor, mask: torch.Tensor | None, max_new_tokens: int
           ) -> tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Prefill a cache for ``prompt + max_new_tokens`` positions; the first logits ``(B, V)`` and
    ``advance(tokens, i)``, which feeds step ``i``'s tokens and gives the next logits."""
    B, T = prompt.shape
    cache = KVCache(B, T + max_new_tokens, len(model.blocks), device=prompt.device)
    if mask is None:  # no padding: positions 0..T-1, and the cache needs no mask
        logits = model.apply(params, prompt, cache=cache)[:, -1]  # (B, V)
        first = torch.full((B, 1), T, dtype=torch.long, device=prompt.device)
    else:
        mask = mask.to(torch.bool)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T): real tokens count from 0
        logits = model.apply(params, prompt, mask=mask, positions=positions, cache=cache)[:, -1]
        first = mask.long().sum(1, keepdim=True)  # (B, 1): the first new token's position
    cache.validated = True  # checked by the prefill; the steps feed the tokens picked here

    def advance(tok: torch.Tensor, i: int) -> torch.Tensor:  # only the newest token, the rest cached
        return model.apply(params, tok[:, None], positions=first + i, cache=cache)[:, -1]
    return logits, advance


def decode_steps(model: Any, logits: torch.Tensor, advance: Callable[[torch.Tensor, int], torch.Tensor],
                 sampling: Sampling, *, steps: int, eos_id: int | None = None, pad_id: int | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """The decode loop: up to ``steps`` tokens ``(B,)``, step ``i``'s picked from ``logits`` ``(B, V)``
    (``sampling.pick``), then ``advance(tokens, i)`` gives the next step's logits. A row that emits
    ``eos_id`` is finished: padded with ``pad_id`` (default ``eos_id``); the output ends at the step
    where the last row finished (the host looks every ``EOS_POLL`` steps, or every step when
    ``on_token`` streams them)."""
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    pad = eos_id if pad_id is None else pad_id
    poll = 1 if on_token is not None else EOS_POLL
    out, finished = [], []  # finished[i]: every row is done after step i (a device bool)
    for i in range(steps):
        tok = sampling.pick(model, logits, i)  # (B,)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            done = done | (tok == eos_id)
            finished.append(done.all())
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if i == steps - 1 or (eos_id is not None and (i + 1) % poll == 0 and bool(finished[-1])):
            break
        logits = advance(tok, i)
    if eos_id is not None and len(out) > 1:  # cut the steps after the one where every row was done
        ends = torch.stack(finished).nonzero()
        if len(ends):
            out = out[:int(ends[0, 0]) + 1]
    return out


def _check(model, prompt, mask, max_new_tokens, sampling: Sampling) -> tuple[int, int]:
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
    name = hook(model, "max_len_name")
    limit = getattr(hook(model, "config"), name, None) if name else None
    if limit is not None and T >= limit:
        raise ValueError(f"{where}: the prompt's {T} tokens leave no room in the model's {name}={limit}; shorten it "
                         f"to at most {limit - 1} tokens.")
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(f"{where}: {T} prompt + {max_new_tokens} new tokens exceed the model's {name}={limit}; "
                         f"generate at most {limit - T} tokens or shorten the prompt.")
    sampling.check(where)
    if getattr(sequence_part(model), "axis", None) is not None:
        raise ValueError(f"{where}: the model splits its sequence over a mesh axis; generate with the unsplit "
                         "(or tensor-parallel) model.")
    return B, T
