"""The memory bench's measurements, on the local backend: ZeRO-3 state bytes within the formula,
no bytes written outside the counted collectives, counted bytes equal to the textbook totals.
(``python -m cfx.bench memory`` runs the same under torchrun; figures in the README.)"""
import pytest

from cfx.bench import memory, memory_worker

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", ["dp", "tp", "zero3"])
def test_no_traffic_outside_the_counted_collectives(name):
    r = memory_worker.measure_traffic(name, True, "local")
    assert r["written_step_bytes"] == r["written_replay_bytes"][0] == r["written_replay_bytes"][1]
    got, want = memory._textbook(name, memory_worker.config(True), r["psi"], r["records"], r["steps"])
    assert abs(got / want - 1) <= 0.01


def test_the_measurement_sees_traffic_outside_collectives():
    rows, _, ok = memory._traffic_rows([[{"strategy": "dp", "steps": 2, "psi": 1, "written_step_bytes": 1200,
                                          "written_replay_bytes": [1000, 1000], "records": []}]],
                                        memory_worker.config(True), "")
    assert not ok and rows[0].value == 100 and not rows[0].ok


def test_zero3_state_stays_within_its_formula():
    r = memory_worker.measure_state("zero3", True, "local")
    n, psi = r["n"], r["psi"]
    for peak, held in r["tracked_peak"].values():
        assert peak <= 1.05 * (16 * psi / n + r["root_bytes"] + r["block_bytes"])
        assert abs(held / (16 * psi / n) - 1) <= 0.01
