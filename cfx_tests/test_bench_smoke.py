"""``python -m cfx.bench NAME --smoke`` for every bench the command knows: each runs its code at toy
sizes to the end and writes well-formed rows. What the rows say (timings above all) is not checked
here: at toy sizes it means nothing; the bench's own test file checks its figures."""
import importlib
import json
import math
import pkgutil

import pytest

import cfx.bench
from cfx.bench.__main__ import BENCHES, main
from cfx.bench.common import size_of

FIELDS = {"metric": str, "value": float, "unit": str, "target": str, "ok": bool}


# benches whose own test file runs the smoke (in child processes, the slowest here) and checks these
# same things of its rows, besides their values: run once, there
OWN_SMOKE = {"capacity": "cfx_tests/test_bench_capacity.py::test_smoke_rows"}


def check_well_formed(name, out):
    """The benches' JSON: ``{"bench", "rows"}``, every row's fields of their types, finite values."""
    assert set(out) == {"bench", "rows"} and out["bench"] == name
    assert out["rows"], f"{name}: no rows"
    for row in out["rows"]:
        assert set(row) == set(FIELDS), row
        assert all(type(row[k]) is t for k, t in FIELDS.items()), row  # an int value is not a float
        assert row["metric"] and math.isfinite(row["value"]), row


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(set(BENCHES) - set(OWN_SMOKE)))
def test_smoke_run_writes_well_formed_rows(name, tmp_path):
    path = tmp_path / f"{name}.json"
    BENCHES[name](smoke=True, json_path=str(path))  # in this process, as `python -m cfx.bench` runs it
    check_well_formed(name, json.loads(path.read_text()))


def test_benches_smoked_elsewhere_are_benches():
    assert set(OWN_SMOKE) <= set(BENCHES)


def test_every_bench_module_is_a_command():
    # a module of cfx.bench with a run() is a bench: `python -m cfx.bench` (and so the test above) must know it
    modules = {m.name for m in pkgutil.iter_modules(cfx.bench.__path__)
               if callable(getattr(importlib.import_module(f"cfx.bench.{m.name}"), "run", None))}
    assert modules == set(BENCHES)


def test_one_size_at_a_time():
    assert [size_of(), size_of(quick=True), size_of(smoke=True)] == ["full", "quick", "smoke"]
    with pytest.raises(ValueError, match="not both"):
        size_of(quick=True, smoke=True)
    with pytest.raises(SystemExit):  # argparse: --quick and --smoke are mutually exclusive
        main(["remat", "--quick", "--smoke"])
