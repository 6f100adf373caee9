"""Benchmarks: ``python -m cfx.bench NAME [--quick] [--json FILE]``.

Each benchmark prints a table and, with ``--json``, writes
``{"bench": NAME, "rows": [{"metric", "value", "unit", "target", "ok"}]}``.
"""
