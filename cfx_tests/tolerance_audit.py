"""How close each ``torch.testing.assert_close`` of the suite came to failing, per call site.

    CFX_TOLERANCE_AUDIT=/tmp/t1.jsonl CFX_TEST_THREADS=1 python -m pytest cfx_tests/test_models_gpt2.py
    python -m cfx_tests.tolerance_audit /tmp/t1.jsonl /tmp/t2.jsonl /tmp/t4.jsonl

With ``CFX_TOLERANCE_AUDIT`` set, ``conftest`` wraps ``torch.testing.assert_close`` (only then, only
in the test process) so that every call appends one JSON line: the test, the call site in
``cfx_tests``, the compared dtype, the tolerances in force and the *margin used*, the largest
``|actual - expected| / (atol + rtol |expected|)`` over the elements (1.0 is the edge of failing).
The report merges runs under several intra-op thread counts and prints, per call site, the worst
margin of any run: a comparison against another library whose fp32 margin is a large fraction of 1
passes or fails by the peers' op order, and belongs in fp64 or under a bound stated from the
computation. Nothing here runs in a normal test run.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch

# torch.testing.assert_close's defaults per dtype (rtol, atol)
_DEFAULTS = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
             torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7)}


def _leaves(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _leaves(v)]
    if isinstance(x, dict):
        return [y for k in sorted(x, key=str) for y in _leaves(x[k])]
    return [x]


def margin(actual: Any, expected: Any, rtol: float | None, atol: float | None) -> tuple[float, str] | None:
    """The largest share of the allowed error any floating element uses, and the dtype compared."""
    worst, dtype = 0.0, None
    a_leaves, e_leaves = _leaves(actual), _leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return None
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(a, float) and isinstance(e, (int, float)):
            a, e = torch.tensor(a, dtype=torch.float64), torch.tensor(float(e), dtype=torch.float64)
            a = a.to(torch.float32)  # a Python float compares at fp32's defaults unless given
            e = e.to(torch.float32)
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            continue
        if not (a.is_floating_point() or a.is_complex()) or a.shape != e.shape or a.numel() == 0:
            continue
        d = torch.promote_types(a.dtype, e.dtype)
        r, t = _DEFAULTS.get(d, (0.0, 0.0))
        r = r if rtol is None else rtol
        t = t if atol is None else atol
        a64, e64 = a.detach().cpu().to(torch.complex128 if d.is_complex else torch.float64), \
            e.detach().cpu().to(torch.complex128 if d.is_complex else torch.float64)
        finite = torch.isfinite(a64) & torch.isfinite(e64)
        err = (a64 - e64).abs()[finite]
        allowed = (t + r * e64.abs())[finite]
        if not err.numel():
            continue
        exact = allowed == 0  # an exact comparison (rtol = atol = 0): 0 where equal, inf where not
        ratio = torch.where(exact, torch.where(err == 0, 0.0, float("inf")), err / allowed.clamp_min(1e-300))
        m = float(ratio.max())
        if m >= worst:
            worst, dtype = m, str(d).removeprefix("torch.")
    return (worst, dtype) if dtype is not None else None


def _call_site() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in reversed(traceback.extract_stack()[:-2]):
        if os.path.abspath(frame.filename).startswith(here) and not frame.filename.endswith("tolerance_audit.py"):
            return f"{os.path.relpath(frame.filename, os.path.dirname(here))}:{frame.lineno}"
    return "?"


def install(path: str) -> None:
    """Wrap ``torch.testing.assert_close`` to append each call's margin to ``path`` (JSON lines)."""
    original = torch.testing.assert_close

    def audited(actual, expected, *args, **kwargs):
        original(actual, expected, *args, **kwargs)  # a failing call raises as before and is not recorded
        try:
            got = margin(actual, expected, kwargs.get("rtol"), kwargs.get("atol"))
        except Exception:  # the audit never changes what a test sees
            got = None
        if got is not None:
            line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], "site": _call_site(),
                    "dtype": got[1], "margin": got[0], "rtol": kwargs.get("rtol"), "atol": kwargs.get("atol"),
                    "threads": torch.get_num_threads()}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    audited.__wrapped__ = original
    torch.testing.assert_close = audited


def report(paths: list[str], *, at_least: float = 0.0) -> list[tuple]:
    """``(site, dtype, worst margin, margins by thread count, tests)`` per call site, worst first."""
    by_site: dict[tuple[str, str], dict] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                s = by_site.setdefault((r["site"], r["dtype"]), {"threads": {}, "tests": set()})
                t = r["threads"]
                s["threads"][t] = max(s["threads"].get(t, 0.0), r["margin"])
                s["tests"].add(r["test"].split("::")[-1].split("[")[0])
    rows = [(site, dtype, max(s["threads"].values()), dict(sorted(s["threads"].items())), sorted(s["tests"]))
            for (site, dtype), s in by_site.items()]
    return sorted((r for r in rows if r[2] >= at_least), key=lambda r: -r[2])


if __name__ == "__main__":
    floor = float(os.environ.get("AT_LEAST", "0.05"))
    for site, dtype, worst, by_threads, tests in report(sys.argv[1:], at_least=floor):
        spread = " ".join(f"{t}t={m:.3g}" for t, m in by_threads.items())
        print(f"{worst:8.3g}  {dtype:8s} {site:55s} {spread}  {','.join(tests)[:80]}")
