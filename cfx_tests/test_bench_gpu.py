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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_gpu_all_without_cuda_skips_every_section():
    from cfx.bench import gpu_all
    rows = gpu_all.run_all()["rows"]
    assert [r["metric"] for r in rows[1:]] == [f"gpu --all: {name}" for name, _, _ in gpu_all.sections(True)]
    assert all(not r["ok"] and r["unit"] == "skipped: no CUDA device" for r in rows[1:])


@pytest.mark.timeout(120)
def test_gpu_all_smoke_runs_the_cpu_halves_and_names_its_sections(monkeypatch, tmp_path):
    """The sections written for the device (LoRA against peft, the serving engine on the device, float8; ZeRO-3's
    steps that the NCCL row runs, here on a local mesh of one) run their CPU halves at toy sizes without a
    failed row; a section name that does not exist is a ValueError, not a run of nothing."""
    import json
    import math

    import cfx
    from cfx.bench import gpu_all, zero
    monkeypatch.setenv("CFX_GPU_ONLY", "lora vs peft, serve, fp8")
    gpu_all.run_all(smoke=True, json_path=str(tmp_path / "all.json"))
    rows = json.loads((tmp_path / "all.json").read_text())["rows"]
    assert not [r for r in rows if r["unit"] == "error"], rows
    names = [r["metric"].split(" (")[0] for r in rows]
    assert "lora_step_vs_peft_gpu" in names and any(n.startswith("serve_throughput_gpu reference") for n in names)
    assert {"fp8_vs_bf16_step_gpu", "fp8_matmul_tflops_gpu"} <= set(names)
    with cfx.Mesh({"data": 1}) as mesh:
        got = zero._zero3_steps(mesh, zero.SIZES["smoke"][0], "cpu")
    assert got["collectives"] > 0 and all(math.isfinite(x) for x in got["losses"] + got["params"])
    assert got["losses"][2] < got["losses"][0]  # AdamW steps that train
    monkeypatch.setenv("CFX_GPU_ONLY", "training,trainig")
    with pytest.raises(ValueError, match="names a section that is not one of"):
        gpu_all.run_all(smoke=True)
