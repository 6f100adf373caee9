"""A request to the engine: what to sample (``SamplingParams``), the sequence it becomes (``Sequence``)
and what each step hands back (``StepOutput``).

Randomness is per request: output token ``i`` of sample ``j`` is drawn with
``fold_in(fold_in(key(seed), j), i)`` (``Sequence.key``), so a request's tokens depend on its seed
alone -- not on what it was batched with, when it arrived, or whether it was preempted and recomputed.
``n == 1`` draws with ``fold_in(key(seed), i)``: ``cfx.generate(..., key=cfx.random.key(seed))`` on the
request alone draws the same.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence as Seq

import torch

from cfx._src.core import random as jr
from cfx._src.generate.pick import Sampling


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request is decoded: up to ``max_tokens`` new tokens, greedy at ``temperature=0`` (else
    ``top_k`` / ``top_p`` and ``seed``), stopping at the model's end-of-sequence token (unless
    ``ignore_eos``) or any of ``stop_token_ids``; ``n`` samples of the one prompt share its blocks;
    ``lora`` names an adapter the engine serves (its rows of a batch run under it)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    lora: str | None = None  # the adapter to run under (Engine.add_adapter), None: the base model

    def check(self, where: str) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens must be a positive int, got {self.max_tokens!r}.")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"{where}: n must be a positive int, got {self.n!r}.")
        if self.temperature > 0 and self.seed is None:
            raise ValueError(f"{where}: sampling (temperature={self.temperature}) needs a seed (SamplingParams(seed=)); "
                             "a request's tokens depend on its seed alone.")
        self.sampling(0).check(where)

    def sampling(self, index: int) -> Sampling:
        """The picking rule of sample ``index`` (its key: module doc)."""
        if self.temperature == 0:
            return Sampling()
        key = jr.key(self.seed)
        return Sampling(self.temperature, self.top_k, self.top_p, key if self.n == 1 else jr.fold_in(key, index))


class Status(enum.Enum):
    WAITING = "waiting"      # not started, or preempted (its blocks given back; recomputed when resumed)
    RUNNING = "running"      # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request as the engine runs it: the prompt, the tokens it produced, its block
    table and how many of its tokens have their keys and values in the cache (``computed``)."""

    request_id: str
    index: int                        # which of the request's n samples
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int                      # the order requests came in (first come, first served)
    output: list[int] = dataclasses.field(default_factory=list)
    table: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    registered: int = 0               # full blocks of the table entered into the prefix cache
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # their keys, in order
    root: bytes | None = None         # what its first block's key starts from (its adapter's)

    def __post_init__(self):
        self.rule = self.params.sampling(self.index)

    def key_before(self, k: int) -> bytes | None:
        """The prefix-cache key block ``k``'s key follows (``blocks.block_hash``'s parent)."""
        return self.hashes[k - 1] if k else self.root

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    def span(self, a: int, n: int) -> list[int]:
        """``tokens[a:a + n]``, without building ``tokens`` (a decode step reads one)."""
        P = len(self.prompt)
        if a >= P:
            return self.output[a - P:a - P + n]
        return [*self.prompt[a:a + n], *self.output[:max(0, a + n - P)]]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def to_compute(self) -> int:
        """Tokens whose keys and values are not cached yet (all but the newest, while decoding)."""
        return self.length - self.computed

    def pick(self, model, logits: torch.Tensor) -> int:
        """The next token from this sequence's last logits ``(V,)``: its own rule at its own step."""
        return int(self.rule.pick(model, logits[None], len(self.output))[0])


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sample: its new token (None when the step only prefilled part
    of the prompt) and, once finished, why (``length``, ``stop``, ``abort``)."""

    request_id: str
    index: int
    token: int | None
    finished: bool
    finish_reason: str | None = None


def check_prompt(prompt: Seq[int], vocab_size: int, max_len: int | None, max_tokens: int, where: str) -> tuple:
    """The prompt as a tuple of ints, after checking it against the model's vocabulary and context."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    prompt = tuple(int(t) for t in prompt)
    if not prompt:
        raise ValueError(f"{where}: the prompt is empty; give it one token at least.")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is outside the model's vocabulary of {vocab_size}.")
    if max_len is not None and len(prompt) >= max_len:
        raise ValueError(f"{where}: the prompt's {len(prompt)} tokens leave no room in the model's context of "
                         f"{max_len}; shorten it to at most {max_len - 1} tokens.")
    if max_len is not None and len(prompt) + max_tokens > max_len:
        raise ValueError(f"{where}: {len(prompt)} prompt + {max_tokens} new tokens exceed the model's context of "
                         f"{max_len}; ask for at most {max_len - len(prompt)} tokens or shorten the prompt.")
    return prompt
