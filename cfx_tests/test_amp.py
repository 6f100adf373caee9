"""cfx.amp.Policy: casts go where the policy says and gradients arrive in the master dtype."""
import pytest
import torch

import cfx


def test_presets_and_from_string():
    p = cfx.amp.policy("bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert cfx.amp.policy("fp16").needs_loss_scaling and not p.needs_loss_scaling
    q = cfx.amp.Policy.from_string("params=float32,compute=float16,output=bfloat16")
    assert (q.compute_dtype, q.output_dtype) == (torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown"):
        cfx.amp.policy("fp4")
    with pytest.raises(ValueError, match="field"):
        cfx.amp.Policy.from_string("weights=fp16")


def test_casts_only_floating_leaves_and_grads_return_fp32():
    p = cfx.amp.policy("bf16")
    params = {"w": torch.ones(3, 2), "ids": torch.arange(3)}
    cast = p.cast_to_compute(params)
    assert cast["w"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.int64

    def f(params, x):
        y = x.to(p.compute_dtype) @ p.cast_to_compute(params)["w"]
        return p.cast_to_output(y).sum()
    g = cfx.grad(f)(params | {"ids": torch.zeros(1)}, torch.ones(4, 3))
    assert g["w"].dtype == torch.float32
    torch.testing.assert_close(g["w"], torch.full((3, 2), 4.0))
