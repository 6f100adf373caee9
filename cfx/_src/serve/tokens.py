"""Text to token ids and back, for ``python -m cfx.generate`` and the server: a Hugging Face tokenizer,
or bytes.

``HFTokenizer(tok)`` wraps a ``transformers`` tokenizer (its chat template too; ``skip_special``: leave
special tokens out of decoded text, as a server does); ``ByteTokenizer`` is the byte-level vocabulary
of ``python -m cfx.train`` checkpoints (ids are UTF-8 bytes; ids past 255 decode to nothing). Both give
``encode(text)``, ``decode(ids)``, ``chat(messages)`` (ValueError where there is no template) and
``eos_id``. ``Detokenizer`` turns a stream of ids into text deltas, holding back an incomplete
UTF-8 character until its last byte comes, finds stop strings in the text so far and holds back the
characters that could still begin one (what was handed out is never taken back).
"""
from __future__ import annotations

from typing import Any, Sequence


class HFTokenizer:
    def __init__(self, tok: Any, *, skip_special: bool = False):
        self.tok, self.eos_id, self.skip_special = tok, tok.eos_token_id, skip_special

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip_special)

    def chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions with a prompt.")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)


class ByteTokenizer:
    """UTF-8 bytes as ids (the training job's byte-level models); chat turns are ``role: content`` lines."""

    eos_id = None
    skip_special = False

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class Detokenizer:
    """Text deltas of a growing list of ids (module doc); ``stop``: strings that end the text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0          # characters of the text handed out so far
        self.stopped = False

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids)

    def add(self, token: int) -> str:
        """The new text once ``token`` is added (empty while a character is incomplete, or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        text = self.text
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                delta, self.sent = text[self.sent:at], at
                return delta
        # held back: an incomplete character, and what could still begin a stop string
        ready = len(text) - (1 if text.endswith("\ufffd") else 0) - max((len(s) - 1 for s in self.stop), default=0)
        delta = text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return delta

    def final(self) -> str:
        """The rest of the text at the end (a trailing incomplete character as the tokenizer decodes it)."""
        if self.stopped:
            return ""
        text = self.text
        delta, self.sent = text[self.sent:], len(text)
        return delta
