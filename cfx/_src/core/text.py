"""Text for people: plain-text tables for CLI summaries and benchmarks, byte counts both ways
(``format_bytes`` / ``parse_bytes``) for budgets, reports and flags, and model output made safe to
print to a terminal (``printable``), lists in words for messages (``join_words``)."""
from __future__ import annotations

import unicodedata
from typing import Any, Iterable, Sequence

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, sep, *body])


def format_bytes(n: float, *, exact: bool = False) -> str:
    """``12.50 MiB`` (the largest binary unit that fits, two decimals); with ``exact=True`` the
    shortest form ``parse_bytes`` reads back to the same integer: ``64MiB``, ``1536KiB``, ``1000``."""
    if exact:
        for unit, size in _BINARY:
            if n % size == 0 and n >= size:
                return f"{int(n) // size}{unit}"
        return str(int(n))
    for unit, size in _BINARY:
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(value: int | str, *, what: str = "budget") -> int:
    """``512MiB`` / ``1.5GB`` / ``4096`` -> bytes; ValueError naming ``what`` and the forms it takes."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be bytes (an int or a string like '512MiB'), got {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    text = str(value).strip().upper().replace(" ", "")
    num = text.rstrip("KMGIB")
    unit = text[len(num):]
    try:
        if unit not in _UNITS:
            raise KeyError(unit)
        return int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"{what} {value!r}: expected bytes as an int or a string like '512MiB', "
                         "'1.5GB' or '4096'.") from None


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab shown as U+FFFD: a model's raw bytes
    (escape sequences, bells, backspaces) cannot move the cursor, recolour or clear the terminal."""
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def join_words(words: Iterable[Any], last: str = "and") -> str:
    """``"a, b and c"`` (``last="or"``: ``"a, b or c"``), for messages that list what is possible."""
    words = [str(w) for w in words]
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)
