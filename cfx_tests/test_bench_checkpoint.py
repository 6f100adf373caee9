"""``python -m cfx.bench checkpoint``: a load holds its blocks and one slice; a save writes each
primary block once; a Plan's state is written once in model coordinates and resumed on another
plan holding one region at a time."""
import pytest

from cfx.bench.checkpoint import run


@pytest.mark.timeout(120)
def test_quick_rows_meet_their_targets(tmp_path):
    rows = {r["metric"].split(" ")[0]: r for r in run(quick=True, json_path=str(tmp_path / "out.json"))["rows"]}
    assert rows["load_peak_bytes_vs_own_blocks"]["ok"], rows["load_peak_bytes_vs_own_blocks"]
    assert 1.0 <= rows["load_peak_bytes_vs_own_blocks"]["value"] < 1.3
    assert rows["save_bytes_vs_primary_blocks"]["ok"], rows["save_bytes_vs_primary_blocks"]
    for name in ("plan_save_bytes_vs_model_state", "plan_load_extra_bytes_vs_own_state"):
        assert rows[name]["ok"], rows[name]
    assert 0 < rows["plan_load_extra_bytes_vs_own_state"]["value"] < 0.2
    assert (tmp_path / "out.json").exists()
