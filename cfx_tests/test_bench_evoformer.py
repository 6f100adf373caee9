"""``python -m cfx.bench evoformer --quick``: AutoChunk's memory rows and DAP's bytes and memory meet
their targets (the slowdown row is a timing: reported, not asserted)."""
import pytest

from cfx.bench.evoformer import run


@pytest.mark.timeout(240)
def test_quick_rows_meet_their_targets(tmp_path):
    rows = {r["metric"].split(" ")[0]: r for r in run(quick=True, json_path=str(tmp_path / "out.json"))["rows"]}
    for name in ("autochunk_memory_reduction", "dap_bytes_vs_formula", "dap_memory_vs_1_over_n"):
        assert rows[name]["ok"], rows[name]
    assert rows["autochunk_slowdown"]["value"] > 0
    assert (tmp_path / "out.json").exists()
