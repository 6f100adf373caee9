"""ZeRO-3's float8 all-gather (``cfx._src.zero.fp8_gather``, ``fp8_comm=all_gather``): the blocks' float8 weights
travel as their e4m3 casts -- one byte an element, half of bf16's two (counted by ``cfx.comm_stats``) -- and the
steps equal the same plan's without it bit for bit (the same scales, the same float8 values), under remat,
Megatron's split and a pipeline too."""
from __future__ import annotations

import math

import pytest
import torch

import cfx


def _run(text: str, steps: int = 3):
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    tokens = cfx.random.randint(cfx.random.key(1), (steps, 8, 33), 0, 64)
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state, losses = step.init(cfx.random.key(0)), []
        with cfx.comm_stats() as stats:
            for i in range(steps):
                state, m = step(state, (tokens[i, :, :-1], tokens[i, :, 1:]))
                losses.append(float(m["loss"]))
        return losses, step.params(state), stats


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text", ["data=2 zero=3", "data=2 zero=3 remat=blocks", "data=2,model=2 zero=3",
                                  "pipe=2,data=2 zero=3 microbatches=2"])
def test_the_float8_all_gather_moves_half_the_bytes_and_changes_no_bit(text):
    plain = _run(f"{text} precision=fp8")
    fp8 = _run(f"{text} precision=fp8 fp8_comm=all_gather")
    assert plain[0] == fp8[0]
    assert all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(plain[1]), cfx.tree.leaves(fp8[1])))
    model_ranks = 2 if "model=2" in text else 1
    # a converted block's six Linear weights, each one rank's tensor-parallel piece over data=2 (the formula)
    weights = [64 * 64] * 4 + [64 * 256] * 2
    per_gather = sum(math.ceil(n // model_ranks / 2) for n in weights)
    for rank in range(2 if "pipe" not in text else 4):
        gathers = plain[2].select(op="all_gather", axes="data", rank=rank)
        cast = [r for r in fp8[2].select(op="all_gather", axes="data", rank=rank) if r.nbytes == r.numel]
        rest = [r for r in fp8[2].select(op="all_gather", axes="data", rank=rank) if r.nbytes != r.numel]
        assert cast and all(r.numel == per_gather for r in cast)  # e4m3: one byte an element
        # the same gathers otherwise; the float8 weights cost half what they cost in bf16
        assert sum(r.nbytes for r in gathers) == sum(r.nbytes for r in rest) + 2 * sum(r.nbytes for r in cast)


@pytest.mark.timeout(120)
def test_describe_counts_the_float8_bytes_the_step_sends():
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    for comm in ("all_gather", "all_gather+reduce_scatter"):
        text = f"data=2 zero=3 precision=fp8 fp8_comm={comm}"
        described = cfx.parallel.Plan.parse(text).describe(model, cfx.optim.adamw(1e-3), batch=(8, 32))
        assert described.collectives == _run(text, steps=1)[2].sent(), text
    # the gathered block: the largest is the first (no float8 there), in the compute dtype (bf16): its 49,152
    # Linear weights and 832 norms and biases whole (a piece of 24,992 from each of the 2 ranks), 2 bytes each
    assert described.bytes["gathered block"] == 2 * 24_992 * 2


def test_fp8_comm_is_refused_where_it_does_not_run():
    for text in ("data=2 zero=2 precision=fp8", "data=2 zero=3 precision=fp8:rowwise", "data=2 zero=3 precision=bf16",
                 "data=2 zero=3 offload=host precision=fp8", "data=2 zero=3 precision=fp8:delayed"):
        with pytest.raises(ValueError, match="fp8_comm=all_gather all-gathers ZeRO-3's weights"):
            cfx.parallel.Plan.parse(f"{text} fp8_comm=all_gather")
    plan = cfx.parallel.Plan.parse("data=2 zero=3 precision=fp8 fp8_comm=all_gather")
    assert cfx.parallel.Plan.parse(str(plan)) == plan and "fp8_comm=all_gather" in str(plan)
    with pytest.raises(ValueError, match="fp8_comm"):
        cfx.parallel.Plan.parse("data=2 zero=3 precision=fp8 fp8_comm=reduce_scatter_please")
