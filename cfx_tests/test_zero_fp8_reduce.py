"""ZeRO-3's gradients reduce-scattered in float8 (``cfx._src.zero.fp8_reduce``, ``fp8_comm=reduce_scatter``): rank
``i`` receives every rank's row ``i`` as its e5m2 cast and scale and sums them in fp32 -- equal bit for bit to that
sum written out here from the spec, within e5m2's rounding of the exact sum, in ``n (S + 4)`` bytes where bf16's
reduce-scatter sends ``2 n S`` -- and a ZeRO-3 plan trains with it as it does without."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import cfx
from cfx import P
from cfx._src.lax import groups
from cfx._src.zero.fp8_reduce import reduce_scatter_fp8


def spec_sum(rows: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i`` of every rank's ``rows`` ``(n, n, S)``: each cast to e5m2 by ``57344 / amax`` (fp64 to fp32,
    saturating), divided back, summed in fp32 in rank order."""
    total = torch.zeros(rows.shape[-1])
    for r in range(rows.shape[0]):
        x = rows[r, i].float()
        s = (57344.0 / x.abs().max().double().clamp(min=1e-12)).float()
        total += (x * s).clamp(-57344, 57344).to(torch.float8_e5m2).float() / s
    return total


@pytest.mark.timeout(120)
@settings(max_examples=6, deadline=None)
@given(n=st.sampled_from([2, 4]), size=st.integers(1, 40), magnitude=st.sampled_from([1e-6, 1.0, 1e4]),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_each_rank_sums_the_e5m2_casts_it_receives(n, size, magnitude, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(n, n, size, generator=g) * magnitude * torch.rand(n, n, 1, generator=g)).to(dtype)

    def body(r):
        return reduce_scatter_fp8(r[0], groups.axes(("data",), "test"))[None]
    with cfx.Mesh({"data": n}) as mesh, cfx.comm_stats() as stats:
        got = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(rows))
    for i in range(n):
        assert torch.equal(got[i], spec_sum(rows, i).to(dtype))
        exact = rows[:, i].double().sum(0)
        assert ((got[i].double() - exact).abs() <= 2**-2 * rows[:, i].double().abs().sum(0) + 1e-30).all()
    assert {r.nbytes for r in stats.select(op="all_to_all")} == {n * (size + 4)}  # e5m2 + the fp32 scale a row


@pytest.mark.timeout(120)
def test_a_zero3_plan_trains_with_its_gradients_in_e5m2():
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    tokens = cfx.random.randint(cfx.random.key(1), (4, 8, 33), 0, 64)

    def run(text):
        plan = cfx.parallel.Plan.parse(text)
        with plan.make_mesh() as mesh, cfx.comm_stats() as stats:
            step = plan.step(model, cfx.optim.adamw(3e-3), mesh=mesh)
            state, losses = step.init(cfx.random.key(0)), []
            for _ in range(4):  # one batch again and again: the loss falls
                state, m = step(state, (tokens[0, :, :-1], tokens[0, :, 1:]))
                losses.append(float(m["loss"]))
        return losses, stats

    plain, s_plain = run("data=2 zero=3 precision=fp8")
    fp8, s_fp8 = run("data=2 zero=3 precision=fp8 fp8_comm=reduce_scatter")
    torch.testing.assert_close(fp8, plain, rtol=2e-3, atol=0)
    assert fp8[-1] < fp8[0]
    assert not s_fp8.select(op="reduce_scatter")
    sent = s_fp8.bytes(op="all_to_all", rank=0)
    assert 0.5 * s_plain.bytes(op="reduce_scatter", rank=0) < sent < 0.51 * s_plain.bytes(op="reduce_scatter", rank=0)
    with pytest.raises(ValueError, match="reduce-scatters ZeRO-3's gradients in e5m2"):
        cfx.parallel.Plan.parse("data=2 zero=2 precision=fp8 fp8_comm=reduce_scatter")
    assert str(cfx.parallel.Plan.parse("data=2 zero=3 precision=fp8 fp8_comm=reduce_scatter+all_gather")).endswith(
        "fp8_comm=all_gather+reduce_scatter")
