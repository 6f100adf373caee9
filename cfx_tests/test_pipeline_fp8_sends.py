"""A pipeline's activations sent in float8 (``fp8_comm=pipe``, ``cfx._src.pipeline.messages.packed``): each goes
as its e4m3 cast by its own amax and its fp32 scale -- ``numel + 4`` bytes where bf16 sends ``2 numel`` (counted
by ``cfx.comm_stats``) -- and the step equals one device's step of the same model whose activation at the stage
boundary is cast and divided back (its gradient passed straight through), which the test writes out."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import cfx
from cfx._src.nn.fp8 import E4M3, scale_of, to_fp8


class _CastBack(torch.autograd.Function):
    """``x``'s e4m3 cast divided by its scale; the gradient straight through (what the stage boundary does)."""

    @staticmethod
    def forward(ctx, x):
        s = scale_of(x, E4M3)
        return (to_fp8(x, E4M3, s).float() / s).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


@dataclasses.dataclass(frozen=True)
class _Boundary:
    """A block whose output is cast to e4m3 and back."""

    block: Any

    def init(self, key):
        return self.block.init(key)

    def axes(self):
        return self.block.axes()

    def apply(self, params, x, **kwargs):
        return _CastBack.apply(self.block.apply(params, x, **kwargs))


@pytest.mark.timeout(240)
def test_pipeline_activations_go_as_e4m3_and_equal_a_cast_at_the_boundary(monkeypatch):
    import contextlib

    import cfx._src.plan.local as local
    from cfx._src.precision import amp

    policy = amp.policy  # fp32 compute with the float8 Linears: sums compare closely
    fp32 = lambda name, **k: amp.Policy(fp8="tensorwise") if name == "fp8" else policy(name, **k)
    monkeypatch.setattr(amp, "policy", fp32)
    monkeypatch.setattr(local, "amp_policy", fp32)
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    index = iter(range(4))
    boundary = model.map_blocks(lambda b: _Boundary(b) if next(index) == 1 else b)  # stage 0's last block
    tokens = cfx.random.randint(cfx.random.key(1), (3, 8, 33), 0, 64)

    def run(text, m):
        plan = cfx.parallel.Plan.parse(f"{text} precision=fp8")
        with plan.make_mesh() if plan.mesh_shape else contextlib.nullcontext() as mesh:
            step = plan.step(m, cfx.optim.sgd(0.5), mesh=mesh)  # (linear in the gradients: they compare)
            state, losses = step.init(cfx.random.key(0)), []
            with cfx.comm_stats() as stats:
                for i in range(3):
                    state, out = step(state, (tokens[i, :, :-1], tokens[i, :, 1:]))
                    losses.append(float(out["loss"]))
            return losses, step.params(state), stats

    ref, ref_params, _ = run("", boundary)
    fp8, fp8_params, stats = run("pipe=2 fp8_comm=pipe", model)
    plain, _, plain_stats = run("pipe=2", model)
    torch.testing.assert_close(fp8, ref, rtol=1e-6, atol=0)
    for a, b in zip(cfx.tree.leaves(fp8_params), cfx.tree.leaves(ref_params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max(abs(a - b) for a, b in zip(plain, ref)) > 10 * max(abs(a - b) for a, b in zip(fp8, ref))
    numel = 8 * 32 * 64  # a microbatch's activations (B, T, C)
    sent = [r.nbytes for r in stats.select(op="send", axes="pipe", rank=0)]
    assert sent == [numel + 4] * 3  # e4m3 and the scale
    assert [r.nbytes for r in plain_stats.select(op="send", axes="pipe", rank=0)] == [4 * numel] * 3  # (fp32 here)
    back = [r.nbytes for r in stats.select(op="send", axes="pipe", rank=1)]
    assert back == [4 * numel] * 3  # gradients go back as they are
    with pytest.raises(ValueError, match="takes a pipe axis and an fp8 precision"):
        cfx.parallel.Plan.parse("data=2 precision=fp8 fp8_comm=pipe")
