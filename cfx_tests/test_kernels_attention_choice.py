"""``impl="auto"`` on CUDA reads ``cfx_kernels.attention_choice``'s measured table: SDPA for a family or
a case nobody measured, the Triton kernel only where a measurement says it wins; off CUDA, SDPA."""
import pytest
import torch

import cfx_kernels.attention_choice as choice
from cfx_kernels._common import device_capability
from cfx._src.nn.attention import _pick_impl


@pytest.fixture
def family(monkeypatch):
    def use(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        device_capability.cache_clear()  # (asked once per device)
    yield use
    device_capability.cache_clear()


def test_unmeasured_families_and_cases_get_sdpa(family, monkeypatch):
    q = torch.zeros(1, 8, 2, 64)
    family((7, 5))
    assert choice.choose(q, causal=True, masked=False) == "sdpa"
    monkeypatch.setitem(choice.TABLE, (8, 0), choice.Measured("sdpa", {(64, True, False): "triton"}, "a test"))
    family((8, 0))
    assert choice.choose(q, causal=True, masked=False) == "triton"  # measured faster
    assert choice.choose(q, causal=False, masked=False) == "sdpa"  # not measured
    assert choice.choose(q, causal=True, masked=True) == "sdpa"
    assert choice.choose(torch.zeros(1, 8, 2, 128), causal=True, masked=False) == "sdpa"


def test_hopper_runs_sdpa_where_the_triton_kernel_measured_slower(family):
    family((9, 0))  # H100 / H200: fwd+bwd 0.55-0.59x SDPA flash (MEASURED.md)
    for D in (64, 128):
        for causal in (True, False):
            assert choice.choose(torch.zeros(1, 8, 2, D), causal=causal, masked=False) == "sdpa"


def test_auto_off_cuda_is_sdpa_and_explicit_choices_stay():
    q = torch.zeros(1, 8, 2, 64)
    assert _pick_impl("auto", q, q, q, causal=True, mask=None) == "sdpa"
    assert _pick_impl("triton", q, q, q, causal=True, mask=None) == "triton"
    with pytest.raises(ValueError, match="impl must be one of"):
        _pick_impl("fast", q, q, q, causal=True, mask=None)
