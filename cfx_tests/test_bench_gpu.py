"""``python -m cfx.bench gpu``: on a machine without CUDA every GPU row is reported as skipped (never
as passing) and ``--smoke`` runs the measuring code on the CPU; on a GPU the rows are measured."""
import pytest
import torch

from cfx.bench import gpu, gpu_generate

NAMES = [m for m, _ in gpu.GPU_ROWS + gpu_generate.GPU_ROWS]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_without_cuda_every_gpu_row_is_skipped_not_passing(capsys):
    rows = gpu.run()["rows"]  # the full size: nothing is measured without CUDA, so it returns at once
    assert [r["metric"] for r in rows] == NAMES
    assert all(not r["ok"] and r["unit"] == "skipped: no CUDA device" for r in rows)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert sum(1 for words in lines if words and words[-1] == "skip") == len(NAMES)  # the table's ok column


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_on_a_gpu_every_row_is_measured():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rows = gpu.run(quick=True)["rows"]
    for name in NAMES:
        (row,) = [r for r in rows if r["metric"].startswith(name + " ")]
        assert not row["unit"].startswith("skipped: no CUDA") and row["value"] == row["value"], row
