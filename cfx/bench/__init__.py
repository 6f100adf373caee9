"""Benchmarks: ``python -m cfx.bench NAME [--quick | --smoke] [--json FILE]``.

Each benchmark prints a table and, with ``--json``, writes
``{"bench": NAME, "rows": [{"metric", "value", "unit", "target", "ok"}]}``. Each ``run`` takes
``quick`` and ``smoke`` (``common.size_of``); ``--smoke`` is what the test suite runs.
"""
